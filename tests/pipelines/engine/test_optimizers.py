"""BertAdam against the release's update rule written out here, SGD against a hand-worked step, and the
optimizer choice."""

from __future__ import annotations

import copy

import pytest
import torch

from pipelines.engine import optimizers, trainer
from pipelines.engine.optimizers import OPTIMIZERS, BertAdam, build_optimizer


def _reference_steps(p0, grads, lr, wd, b1=0.9, b2=0.999, eps=1e-6):
    """LXMERT's rule step by step, in float64: moments without bias correction, eps outside the square root,
    weight decay added to the update before the learning rate, no clip of a parameter's own gradient."""
    p, m, v = (
        p0.double().clone(),
        torch.zeros_like(p0, dtype=torch.float64),
        torch.zeros_like(p0, dtype=torch.float64),
    )
    out = []
    for g, step_lr in zip(grads, lr, strict=True):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - step_lr * (m / (v.sqrt() + eps) + wd * p)
        out.append(p.clone())
    return out


@pytest.mark.parametrize("wd", [0.01, 0.0])
def test_bertadam_follows_the_release_rule_over_several_steps(wd):
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(5, 3, generator=gen)
    grads = [torch.randn(5, 3, generator=gen) * s for s in (1.0, 0.1, 3.0, 1e-4)]
    lrs = [1e-3, 5e-4, 2e-3, 1e-3]  # a schedule changes lr between steps
    param = torch.nn.Parameter(p0.clone())
    opt = BertAdam([param], lr=lrs[0], weight_decay=wd)
    expected = _reference_steps(p0, grads, lrs, wd)
    for g, lr, want in zip(grads, lrs, expected, strict=True):
        for group in opt.param_groups:
            group["lr"] = lr
        param.grad = g.clone()
        opt.step()
        torch.testing.assert_close(param.detach().double(), want, rtol=1e-6, atol=1e-7)


def test_first_bertadam_step_differs_from_bias_corrected_adam():
    # without bias correction the first step is lr * g(1-b1)/(|g|sqrt(1-b2) + eps) ~ 3.16 lr, not lr
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    BertAdam([param], lr=0.1, weight_decay=0.0).step()
    assert param.item() == pytest.approx(-0.1 * 0.1 / (0.001**0.5 + 1e-6), rel=1e-5)


def test_state_round_trips_through_state_dict():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, generator=gen) for _ in range(4)]
    a = torch.nn.Parameter(torch.ones(4))
    opt_a = BertAdam([a], lr=0.01)
    for g in grads[:2]:
        a.grad = g.clone()
        opt_a.step()
    b = torch.nn.Parameter(a.detach().clone())
    opt_b = BertAdam([b], lr=0.01)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as read back from a checkpoint
    for g in grads[2:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)


def test_build_optimizer_names():
    param = torch.nn.Parameter(torch.ones(2))
    assert isinstance(build_optimizer("bertadam", [{"params": [param]}], 0.1, 0.01), BertAdam)
    adamw = build_optimizer("adamw", [{"params": [param]}], 0.1, 0.01)
    assert isinstance(adamw, torch.optim.AdamW)
    sgd = build_optimizer("sgd", [{"params": [param]}], 0.1, 0.01, momentum=0.5)
    assert isinstance(sgd, torch.optim.SGD)
    assert (sgd.defaults["momentum"], sgd.defaults["nesterov"], sgd.defaults["dampening"]) == (0.5, False, 0)
    assert build_optimizer("sgd", [{"params": [param]}], 0.1, 0.01).defaults["momentum"] == 0.9
    assert set(OPTIMIZERS) == {"bertadam", "adamw", "sgd"}
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        build_optimizer("lamb", [{"params": [param]}], 0.1, 0.01)


def test_sgd_steps_with_momentum_and_l2_decay():
    # detectron2's rule, worked by hand with lr 0.1, wd 0.01, momentum 0.9, p0 = 1, g = 0.5 then -0.25:
    # d1 = 0.5 + 0.01 * 1 = 0.51;  buf = 0.51;  p1 = 1 - 0.1 * 0.51 = 0.949
    # d2 = -0.25 + 0.01 * 0.949 = -0.24051;  buf = 0.9 * 0.51 - 0.24051 = 0.21849;  p2 = 0.949 - 0.021849
    param = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
    opt = build_optimizer("sgd", [{"params": [param]}], 0.1, 0.01, momentum=0.9)
    for g, want in ((0.5, 0.949), (-0.25, 0.927151)):
        param.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        assert param.item() == pytest.approx(want, rel=1e-12, abs=1e-12)


def _release_warmup_linear(x: float, warmup: float) -> float:
    if x < warmup:
        return x / warmup
    return max((x - 1.0) / (warmup - 1.0), 0.0)


def _release_bertadam_step(params, states, lr, t_total, warmup, wd, b1=0.9, b2=0.999, e=1e-6, max_norm=1.0):
    """pytorch-pretrained-bert 0.6.2's BertAdam.step for one group, transcribed expression by expression
    (its deprecated `add_(scalar, tensor)` forms in today's spelling): one parameter at a time, its own
    gradient clipped, the schedule's rate from its own step count."""
    for p in params:
        if p.grad is None:
            continue
        grad = p.grad.data
        if p not in states:
            states[p] = {"step": 0, "next_m": torch.zeros_like(p), "next_v": torch.zeros_like(p)}
        state = states[p]
        next_m, next_v = state["next_m"], state["next_v"]
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_(p, max_norm)
        next_m.mul_(b1).add_(grad, alpha=1 - b1)
        next_v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        update = next_m / (next_v.sqrt() + e)
        if wd > 0.0:
            update += wd * p.data
        lr_scheduled = lr * _release_warmup_linear(state["step"] / t_total, warmup)
        update_with_lr = lr_scheduled * update
        p.data.add_(-update_with_lr)
        state["step"] += 1


@pytest.mark.parametrize(("chunk", "max_norm"), [(2**24, 1.0), (40, 1.0), (2**24, None), (40, None)])
def test_bertadam_is_bitwise_the_release_over_50_steps(monkeypatch, chunk, max_norm):
    """Through the trainer's warm-up-linear scheduler, as a run steps it: two groups (one without decay),
    several shapes, one parameter without a gradient, gradients from 1e-4 to 10 (so some are clipped);
    chunk 40 splits the lists (the 7 x 9 matrix is a chunk of its own). max_norm 1.0 is
    pytorch-pretrained-bert's per-parameter clip; None, the default, LXMERT's copy, which has none."""
    monkeypatch.setattr(optimizers, "FOREACH_CHUNK", chunk)
    steps, warmup, lr = 50, 0.1, 1e-3
    gen = torch.Generator().manual_seed(2)
    shapes = [(7, 9), (9,), (3, 4, 5), (1,), (30,), (2, 2), (64, 16)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    groups = [{"params": ours[:4]}, {"params": ours[4:], "weight_decay": 0.0}]
    opt = BertAdam(
        groups, lr=lr, weight_decay=0.01, **({} if max_norm is None else {"max_grad_norm": max_norm})
    )
    max_norm = max_norm or 0.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, trainer._schedule(trainer.TrainConfig(warmup_ratio=warmup), steps)
    )
    states: dict = {}
    clipped = 0
    for _ in range(steps):
        grads = [
            torch.randn(s, generator=gen) * 10 ** float(torch.randint(-4, 2, (), generator=gen))
            for s in shapes
        ]
        grads[3] = None
        clipped += sum(g is not None and float(g.norm()) > 1.0 for g in grads)
        for p, q, g in zip(ours, theirs, grads, strict=True):  # each its own: clipping writes to it
            p.grad, q.grad = (None, None) if g is None else (g.clone(), g.clone())
        opt.step()
        scheduler.step()
        with torch.no_grad():
            _release_bertadam_step(theirs[:4], states, lr, steps, warmup, 0.01, max_norm=max_norm)
            _release_bertadam_step(theirs[4:], states, lr, steps, warmup, 0.0, max_norm=max_norm)
        drift = [float((p - q).detach().abs().max()) for p, q in zip(ours, theirs, strict=True)]
        assert max(drift) == 0.0, (len(states), drift)
    assert clipped > 20 and not torch.equal(ours[0], start[0])
    assert torch.equal(ours[3], start[3]) and ours[3] not in opt.state
    assert [float(opt.state[p]["step"]) for p in ours if p.grad is not None] == [50.0] * 6


def test_an_optimizer_state_saved_without_max_grad_norm_loads_without_a_per_parameter_clip():
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), 2.0)
    opt = BertAdam([param], lr=0.1)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    del saved["param_groups"][0]["max_grad_norm"]
    fresh = BertAdam([torch.nn.Parameter(torch.ones(3))], lr=0.1, max_grad_norm=5.0)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["max_grad_norm"] == optimizers.BERTADAM_MAX_GRAD_NORM == 0.0


def test_adamw_is_fused_when_asked():
    param = torch.nn.Parameter(torch.ones(2))
    assert build_optimizer("adamw", [{"params": [param]}], 0.1, 0.01, fused=True).defaults["fused"] is True
    assert not build_optimizer("adamw", [{"params": [param]}], 0.1, 0.01).defaults["fused"]
