"""TiedWords: the paired lookup and MLM decoder give plain autograd's gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.tied import TiedWords


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


def test_each_forward_has_its_own_hand_off():
    table = torch.randn(20, 4, requires_grad=True)
    bias = torch.zeros(20)
    ids = torch.tensor([[1, 2, 3]])
    first, second = TiedWords(table), TiedWords(table)
    a = first.decode(first.lookup(ids), bias).sum()
    b = second.decode(second.lookup(ids), bias).sum()
    (a + b).backward()
    assert first.pending is None and second.pending is None
    single = torch.randn(20, 4).copy_(table.detach()).requires_grad_()
    pair = TiedWords(single)
    (2 * pair.decode(pair.lookup(ids), bias).sum()).backward()
    torch.testing.assert_close(table.grad, single.grad)
