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
        # The decoder's gradient until the lookup takes it, tagged with the backward pass that made it:
        # a pass that stops short of the lookup (autograd.grad of a head's bias, say) must not leave it
        # to the next pass over the same graph.
        self.pending: torch.Tensor | None = None
        self.pass_id = -1

    def hand_over(self, grad: torch.Tensor) -> None:
        """Called by the decoder's backward."""
        current = torch._C._current_graph_task_id()
        if self.pending is not None and self.pass_id == current:
            self.pending.add_(grad)
        else:
            self.pending, self.pass_id = grad, current

    def take(self) -> torch.Tensor | None:
        """Called by the lookup's backward: this pass's decoder gradient, if any."""
        pending, self.pending = self.pending, None
        return pending if self.pass_id == torch._C._current_graph_task_id() else None

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
        ctx.tied.hand_over(grad_w)
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
        table = ctx.tied.take()
        if table is None:  # the decoder was not part of this backward
            table = grad.new_zeros(ctx.table_shape)
        table.index_add_(0, ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).to(table.dtype))
        return table, None, None
