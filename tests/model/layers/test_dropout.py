"""The CPU dropout: rate, scaling, gradient, modes and dtypes."""

from __future__ import annotations

import pytest
import torch

from model.layers.dropout import Dropout, dropout


def test_drops_at_rate_p_and_scales_the_rest():
    torch.manual_seed(0)
    x = torch.rand(1000, 1000) + 0.5  # never 0, so a 0 in the output is a drop
    y = dropout(x, 0.1, training=True)
    dropped = y == 0
    # 10^6 draws: the binomial standard deviation of the rate is 3e-4.
    assert abs(dropped.float().mean().item() - 0.1) < 2e-3
    torch.testing.assert_close(y[~dropped], x[~dropped] / 0.9)


def test_gradient_is_the_same_mask_and_scale():
    torch.manual_seed(1)
    x = torch.randn(64, 32, requires_grad=True)
    y = dropout(x, 0.3, training=True)
    g = torch.randn_like(y)
    y.backward(g)
    kept = y != 0
    torch.testing.assert_close(x.grad, torch.where(kept, g / 0.7, torch.zeros_like(g)))


def test_rate_one_and_bad_rates():
    x = torch.randn(4, 4, requires_grad=True)
    y = dropout(x, 1.0, training=True)
    assert not y.any()
    y.sum().backward()
    assert not x.grad.any()
    for p in (-0.1, 1.5):
        with pytest.raises(ValueError, match="between 0 and 1"):
            Dropout(p)
        with pytest.raises(ValueError, match="between 0 and 1"):
            dropout(x, p, training=True)


def test_torch_func_grad_goes_through():
    x = torch.rand(32, 32) + 0.5

    def f(t: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(4)
        return dropout(t, 0.25, training=True).sum()

    grad = torch.func.grad(f)(x)
    torch.manual_seed(4)
    kept = dropout(x, 0.25, training=True) != 0
    torch.testing.assert_close(grad, kept.float() / 0.75)


def test_eval_and_zero_rate_are_the_identity():
    x = torch.randn(8, 8)
    assert dropout(x, 0.1, training=False) is x
    assert dropout(x, 0.0, training=True) is x
    module = Dropout(0.5).eval()
    assert module(x) is x and "p=0.5" in repr(module)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_keeps_the_input_dtype(dtype):
    torch.manual_seed(2)
    x = torch.randn(256, 256, dtype=dtype, requires_grad=True)
    y = Dropout(0.1).train()(x)
    assert y.dtype == dtype
    y.sum().backward()
    assert x.grad.dtype == dtype
    assert abs((y == 0).float().mean().item() - 0.1) < 0.01


def test_seeded_runs_repeat():
    x = torch.randn(100, 100)
    torch.manual_seed(3)
    a = dropout(x, 0.2, training=True)
    torch.manual_seed(3)
    b = dropout(x, 0.2, training=True)
    assert torch.equal(a, b)
