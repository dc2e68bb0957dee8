"""LXMERT's transformer layers: single-modality encoder layers and the cross-modality layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import MultiHeadAttention, Rows, attention_probs
from ..layers.dropout import Dropout
from .config import LxmertConfig


def _attention(cfg: LxmertConfig) -> MultiHeadAttention:
    return MultiHeadAttention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.attention_probs_dropout_prob,
        cfg.hidden_dropout_prob,
        cfg.layer_norm_eps,
    )


class FeedForward(nn.Module):
    """`LN(x + dropout(down(gelu(up(x)))))` with the exact (erf) GELU."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.dropout = Dropout(cfg.hidden_dropout_prob)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.dropout(self.down(F.gelu(self.up(x)))))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward: a language or object-relationship layer."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.attention = _attention(cfg)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, layout: Rows) -> torch.Tensor:
        return self.ffn(self.attention(x, layout))


class CrossLayer(nn.Module):
    """Cross-modality layer: shared cross-attention both ways, then per-modality self-attention and FFN."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.cross_attention = _attention(cfg)
        self.lang_attention = _attention(cfg)
        self.vision_attention = _attention(cfg)
        self.lang_ffn = FeedForward(cfg)
        self.vision_ffn = FeedForward(cfg)

    def forward(
        self,
        lang: torch.Tensor,
        lang_layout: Rows,
        vision: torch.Tensor,
        vision_layout: Rows,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """lang/vision: rows of their layouts. Returns the new rows of both and, on request,
        the language->vision attention weights (B, heads, L, N)."""
        # The shared module sees both modalities' rows stacked: one GEMM per projection instead of
        # two, and one weight gradient to accumulate; every step is row-wise, so results are the same.
        cross = self.cross_attention
        sizes = [lang.shape[0], vision.shape[0]]  # split, not sliced: its backward is a cat, no zero fill
        both = torch.cat([lang, vision])
        lang_qkv, vision_qkv = cross.qkv(both).split(sizes)
        lq, lk, lv = cross.split(lang_layout.to_batch(lang_qkv))
        vq, vk, vv = cross.split(vision_layout.to_batch(vision_qkv))
        lang_ctx = cross.attend(lq, vk, vv, vision_layout.mask)
        vision_ctx = cross.attend(vq, lk, lv, lang_layout.mask)
        probs = attention_probs(lq, vk, vision_layout.mask) if output_attentions else None
        context = torch.cat([lang_layout.to_rows(lang_ctx), vision_layout.to_rows(vision_ctx)])
        lang, vision = cross.finish(context, both).split(sizes)
        lang = self.lang_ffn(self.lang_attention(lang, lang_layout))
        vision = self.vision_ffn(self.vision_attention(vision, vision_layout))
        return lang, vision, probs
