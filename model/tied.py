"""The word table shared by the input lookup and the MLM decoder, with one gradient buffer per step."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TiedWords:
    """Pairs one forward's word lookup with its MLM decoding over the same (vocab, hidden) table.

    Plain autograd builds the table's gradient from two dense buffers: a zero-filled one that the lookup
    scatters its rows into, and the decoder's product, then adds them. Here the decoder's backward,
    which always runs first (the decoder reads states computed from the looked-up words), leaves its
    product with this object and the lookup's backward scatters its rows into that same buffer and
    returns it. At the base size that spares a 94 MB zero fill per step. One instance serves one
    forward; nothing lives on the module, so replicas and threads cannot share a buffer.
    """

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.pending: torch.Tensor | None = None  # the decoder's gradient, until the lookup takes it

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the table for `ids` (B, L) -> (B, L, hidden)."""
        return _Lookup.apply(self.weight, ids, self)

    def decode(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """`x @ table.T + bias`: vocabulary logits."""
        return _Decode.apply(x, self.weight, bias, self)


class _Decode(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, tied: TiedWords
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.tied = tied
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        # Under autocast the forward ran in x's dtype; the table's gradient is kept in the table's.
        grad = grad.reshape(-1, grad.shape[-1])
        grad_x = (grad @ weight.to(grad.dtype)).view(x.shape)
        grad_w = (grad.t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype)).to(weight.dtype)
        tied = ctx.tied
        tied.pending = grad_w if tied.pending is None else tied.pending.add_(grad_w)
        return grad_x, None, grad.sum(0), None


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, ids: torch.Tensor, tied: TiedWords) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.tied = tied
        ctx.table_shape = weight.shape
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (ids,) = ctx.saved_tensors
        tied = ctx.tied
        table, tied.pending = tied.pending, None
        if table is None:  # the decoder was not part of this loss
            table = grad.new_zeros(ctx.table_shape)
        table.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(table.dtype))
        return table, None, None
