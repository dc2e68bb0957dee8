"""TiedWords: the paired lookup and MLM decoder give plain autograd's gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.layers.tied import TiedWords


def _grads(tied: bool, decodes: int):
    torch.manual_seed(0)
    table = torch.randn(50, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True)
    mix = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 50, (3, 5))
    ids[0, :2] = 7  # a repeated id accumulates
    pair = TiedWords(table) if tied else None
    words = pair.lookup(ids) if tied else F.embedding(ids, table)
    states = torch.tanh(words @ mix)
    loss = states.pow(2).sum()
    for k in range(decodes):
        x = states[:, k]
        logits = pair.decode(x, bias) if tied else F.linear(x, table, bias)
        loss = loss + logits.log_softmax(-1)[:, k].sum()
    loss.backward()
    return table.grad, bias.grad, mix.grad


def test_gradients_equal_plain_autograd():
    for decodes in (0, 1, 3):  # no decoder in the loss; once; several times in one step
        expected = _grads(tied=False, decodes=decodes)
        got = _grads(tied=True, decodes=decodes)
        for name, a, b in zip(("table", "bias", "mix"), got, expected, strict=True):
            if b is None:
                assert a is None, name
            else:
                torch.testing.assert_close(a, b, msg=f"{name}, {decodes} decodes")


def test_a_backward_that_stops_short_of_the_lookup_leaves_nothing_behind():
    """A per-head gradient (autograd.grad of the decoder bias, retain_graph) before the full backward:
    the first pass's decoder gradient must not be counted again in the second."""

    def table_grad(tied: bool) -> torch.Tensor:
        torch.manual_seed(0)
        table = torch.randn(20, 4, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(20, dtype=torch.float64, requires_grad=True)
        ids = torch.tensor([[1, 2, 3]])
        pair = TiedWords(table)
        words = pair.lookup(ids) if tied else F.embedding(ids, table)
        logits = pair.decode(torch.tanh(words), bias) if tied else F.linear(torch.tanh(words), table, bias)
        loss = logits.log_softmax(-1)[..., 0].sum()
        torch.autograd.grad(loss, [bias], retain_graph=True)
        loss.backward(inputs=[bias], retain_graph=True)
        loss.backward()
        return table.grad

    torch.testing.assert_close(table_grad(tied=True), table_grad(tied=False))


def test_forwards_do_not_share_a_hand_off():
    """Two forwards over two tables in one backward: each table gets its own gradient."""
    torch.manual_seed(1)
    tables = [torch.randn(20, 4, requires_grad=True) for _ in range(2)]
    plain = [t.detach().clone().requires_grad_() for t in tables]
    bias = torch.zeros(20)
    ids = torch.tensor([[1, 2, 3]])
    pairs = [TiedWords(t) for t in tables]
    sum((k + 1) * p.decode(p.lookup(ids), bias).pow(2).sum() for k, p in enumerate(pairs)).backward()
    sum((k + 1) * F.linear(F.embedding(ids, t), t, bias).pow(2).sum() for k, t in enumerate(plain)).backward()
    for got, expected in zip(tables, plain, strict=True):
        torch.testing.assert_close(got.grad, expected.grad)
    assert all(p.pending is None for p in pairs)
