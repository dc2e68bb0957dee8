"""Multi-head attention with a fused QKV projection and LXMERT's post-LN residual output."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def key_padding_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, K) 1 = real / 0 = padding  ->  boolean (B, 1, 1, K) for attention (True = attend)."""
    if mask is None:
        return None
    return mask.to(torch.bool)[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """Attention whose output is `LN(x + dropout(out(attn)))`.

    One `qkv` projection serves both self-attention and LXMERT's shared cross-attention: the cross
    layer projects each modality once and pairs one side's queries with the other side's keys/values.
    """

    def __init__(self, hidden: int, heads: int, attn_dropout: float, hidden_dropout: float, eps: float):
        super().__init__()
        self.heads = heads
        self.attn_dropout = attn_dropout
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.dropout = nn.Dropout(hidden_dropout)
        self.norm = nn.LayerNorm(hidden, eps=eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, S, H) -> query, key, value, each (B, heads, S, head_dim)."""
        b, s, h = x.shape
        return self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4).unbind(0)

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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = self.project(x)
        return self.finish(self.attend(q, k, v, mask), x)


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax weights (B, heads, S_q, S_k); computed explicitly because SDPA does not return them."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)
