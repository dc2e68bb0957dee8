"""Padding-free row layout and multi-head attention with a post-LN residual output (BERT, LXMERT)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .dropout import Dropout

_STATIC = False


@contextlib.contextmanager
def static_layout(on: bool = True) -> Iterator[None]:
    """Inside, `Rows` (and the one-stream encoder) keep the padded layout and ask the device nothing: every
    position is a row, padding is masked out of attention and zeroed where rows return to the batch, so
    shapes follow the batch's size alone and a compiled step has no graph break or host sync. Real
    positions get the same values as the padding-free rows up to rounding. Outside (the default), the
    padding-free rows: the reference, and the faster layout for an eager step."""
    global _STATIC
    before, _STATIC = _STATIC, on
    try:
        yield
    finally:
        _STATIC = before


def static_layout_on() -> bool:
    return _STATIC


class Rows:
    """A padded batch (B, S, ·) held as the rows of its real positions only: (T, ·), T = mask ones.

    Linear layers, LayerNorm, GELU and dropout act row by row, so the encoders run them on the T real
    rows alone (a batch of sentences of 10 to 20 tokens padded to 20 skips a quarter of the language
    arithmetic). Attention needs the (B, S) layout and gets it from `to_batch`, with zero rows at the
    padding; `mask` keeps those out of every key. Without padding both conversions are views.
    Under `static_layout()` every position is a row (T = B x S) and `left_padded` is not looked at.
    """

    def __init__(self, mask: torch.Tensor | None, batch: int, length: int):
        self.shape = (batch, length)
        self.index: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None  # (B, 1, 1, S), True = attend
        self.keep: torch.Tensor | None = None  # (B x S, 1), static layout: False = padding, zeroed
        self.left_padded = False  # some row's first position is padding
        if mask is not None:
            real = mask.to(torch.bool)
            if _STATIC:
                self.mask, self.keep = real[:, None, None, :], real.reshape(-1, 1)
                return
            index = real.flatten().nonzero().squeeze(1)  # one host sync; a second only with padding
            if index.numel() < batch * length:
                self.index = index
                self.mask = real[:, None, None, :]
                self.left_padded = not bool(real[:, 0].all())

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, F) -> (T, F)."""
        x = x.reshape(-1, x.shape[-1])
        return x if self.index is None else x.index_select(0, self.index)

    def to_batch(self, rows: torch.Tensor) -> torch.Tensor:
        """(T, F) -> (B, S, F), zeros at the padding."""
        b, s = self.shape
        if self.index is not None:
            rows = rows.new_zeros(b * s, rows.shape[-1]).index_copy(0, self.index, rows)
        elif self.keep is not None:
            rows = rows.masked_fill(~self.keep, 0)
        return rows.view(b, s, -1)


class MultiHeadAttention(nn.Module):
    """Attention whose output is `LN(x + dropout(out(attn)))`, on rows laid out by `Rows`.

    One `qkv` projection serves both self-attention and LXMERT's shared cross-attention: the cross
    layer projects each modality once and pairs one side's queries with the other side's keys/values.
    """

    def __init__(self, hidden: int, heads: int, attn_dropout: float, hidden_dropout: float, eps: float):
        super().__init__()
        self.heads = heads
        self.attn_dropout = attn_dropout
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.dropout = Dropout(hidden_dropout)
        self.norm = nn.LayerNorm(hidden, eps=eps)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, S, 3H) projections -> query, key, value, each (B, heads, S, head_dim)."""
        b, s, _ = qkv.shape
        return qkv.view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Scaled dot-product attention; returns the context as (B, S_q, H)."""
        p = self.attn_dropout if self.training else 0.0
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        b, _, s, _ = ctx.shape
        return ctx.transpose(1, 2).reshape(b, s, -1)

    def finish(self, context: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.norm(residual + self.dropout(self.out(context)))

    def forward(self, x: torch.Tensor, layout: Rows) -> torch.Tensor:
        """x: (T, H) rows of `layout`."""
        q, k, v = self.split(layout.to_batch(self.qkv(x)))
        return self.finish(layout.to_rows(self.attend(q, k, v, layout.mask)), x)


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax weights (B, heads, S_q, S_k); computed explicitly because SDPA does not return them."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)
