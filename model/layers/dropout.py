"""Dropout that keeps a one-byte mask and draws it with `torch.rand` on CPU, where that is faster."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _MaskedScale(torch.autograd.Function):
    """`x * keep / (1 - p)` saving only the boolean `keep` mask for the backward."""

    generate_vmap_rule = True  # with setup_context below, torch.func transforms work through it

    @staticmethod
    def forward(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        return x.mul(keep).mul_(scale)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
        _, keep, scale = inputs
        ctx.save_for_backward(keep)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None, None


def _check_rate(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`F.dropout`, except on CPU: there `bernoulli_` plus a float mask costs about twice a uniform draw
    compared with `p` and a boolean mask. The mask is drawn in fp32 whatever `x`'s dtype, so `p` is exact
    to 2^-24 under bf16 autocast too."""
    _check_rate(p)
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    keep = torch.rand(x.shape, device=x.device) >= p
    return _MaskedScale.apply(x, keep, 1.0 / (1.0 - p))


class Dropout(nn.Module):
    """Drop-in for `nn.Dropout` that uses `dropout` above."""

    def __init__(self, p: float):
        super().__init__()
        _check_rate(p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
