"""Transformer layers: single-modality encoder layers and the cross-modality layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import MultiHeadAttention, attention_probs
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
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.dropout(self.down(F.gelu(self.up(x)))))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward: a language or object-relationship layer."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.attention = _attention(cfg)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.ffn(self.attention(x, mask))


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
        lang_mask: torch.Tensor | None,
        vision: torch.Tensor,
        vision_mask: torch.Tensor | None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Returns the new language and vision states and, on request, language->vision attention."""
        # The shared module sees both modalities as one sequence: one GEMM per projection instead of
        # two, and one weight gradient to accumulate; every step is row-wise, so results are the same.
        cross = self.cross_attention
        length = lang.shape[1]
        both = torch.cat([lang, vision], 1)
        q, k, v = cross.project(both)
        lq, lk, lv = (t[:, :, :length] for t in (q, k, v))
        vq, vk, vv = (t[:, :, length:] for t in (q, k, v))
        probs = attention_probs(lq, vk, vision_mask) if output_attentions else None
        context = torch.cat([cross.attend(lq, vk, vv, vision_mask), cross.attend(vq, lk, lv, lang_mask)], 1)
        both = cross.finish(context, both)
        lang_x, vision_x = both[:, :length], both[:, length:]
        lang = self.lang_ffn(self.lang_attention(lang_x, lang_mask))
        vision = self.vision_ffn(self.vision_attention(vision_x, vision_mask))
        return lang, vision, probs
