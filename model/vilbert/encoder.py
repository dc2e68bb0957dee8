"""ViLBERT's streams: BERT layers for text and regions, co-attention layers between them, and their order.

Module and parameter names follow vilbert-multi-task (`layer`, `v_layer`, `c_layer` with `biattention`,
`biOutput`, `v_intermediate`, `v_output`, `t_intermediate`, `t_output`), so released weights load by name.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from model.layers.dropout import Dropout

from .config import VilbertConfig

Step = tuple[Literal["text", "vision", "co"], int]


def schedule(cfg: VilbertConfig) -> list[Step]:
    """The order layers run in: before co-attention layer k, the text layers up to t_biattention_id[k]
    and the visual layers up to v_biattention_id[k]; after the last one, the remaining visual then text
    layers (the release's loop). Base: text 0-5, co 0, then 5 x (text, visual, co), then visual 5, text 11."""
    steps: list[Step] = []
    t = v = 0
    for k, (v_end, t_end) in enumerate(zip(cfg.v_biattention_id, cfg.t_biattention_id, strict=True)):
        steps += [("text", i) for i in range(t, t_end)]
        steps += [("vision", i) for i in range(v, v_end)]
        steps.append(("co", k))
        t, v = t_end, v_end
    steps += [("vision", i) for i in range(v, cfg.v_num_hidden_layers)]
    steps += [("text", i) for i in range(t, cfg.num_hidden_layers)]
    return steps


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, H) -> (B, heads, S, H / heads)."""
    b, s, _ = x.shape
    return x.view(b, s, heads, -1).transpose(1, 2)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    dropout: float,
    need_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Multi-head attention over keys where `mask` (B, 1, 1, S_k) is True; returns the context (B, S_q, H)
    and, when asked, the softmax weights (B, heads, S_q, S_k) before dropout."""
    if need_probs:
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        ctx = F.dropout(probs, dropout, training=dropout > 0) @ v
    else:
        probs = None
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
    b, _, s, _ = ctx.shape
    return ctx.transpose(1, 2).reshape(b, s, -1), probs


class ResidualOutput(nn.Module):
    """`LN(residual + dropout(dense(x)))`, BERT's post-LN sublayer output."""

    def __init__(self, in_dim: int, hidden: int, dropout: float, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_dim, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dropout(self.dense(x)))


class Intermediate(nn.Module):
    """`gelu(dense(x))`, the first half of the feed-forward block."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.dense = nn.Linear(hidden, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, need_probs: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v = (split_heads(proj(x), self.heads) for proj in (self.query, self.key, self.value))
        return attend(q, k, v, mask, self.dropout if self.training else 0.0, need_probs)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, attn_dropout: float, hidden_dropout: float, eps: float):
        super().__init__()
        self.self = SelfAttention(hidden, heads, attn_dropout)
        self.output = ResidualOutput(hidden, hidden, hidden_dropout, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask)[0], x)


class Layer(nn.Module):
    """A BERT layer: self-attention then feed-forward, each post-LN (text and visual streams alike)."""

    def __init__(
        self, hidden: int, heads: int, inner: int, attn_dropout: float, hidden_dropout: float, eps: float
    ):
        super().__init__()
        self.attention = Attention(hidden, heads, attn_dropout, hidden_dropout, eps)
        self.intermediate = Intermediate(hidden, inner)
        self.output = ResidualOutput(inner, hidden, hidden_dropout, eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BiAttention(nn.Module):
    """Co-attention: text queries (`query2`) over region keys/values (`key1`/`value1`) and region queries
    (`query1`) over text keys/values (`key2`/`value2`), all projected to `bi_hidden_size`."""

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        bi = cfg.bi_hidden_size
        self.heads = cfg.bi_num_attention_heads
        self.query1 = nn.Linear(cfg.v_hidden_size, bi)
        self.key1 = nn.Linear(cfg.v_hidden_size, bi)
        self.value1 = nn.Linear(cfg.v_hidden_size, bi)
        self.query2 = nn.Linear(cfg.hidden_size, bi)
        self.key2 = nn.Linear(cfg.hidden_size, bi)
        self.value2 = nn.Linear(cfg.hidden_size, bi)
        self.dropout1 = cfg.v_attention_probs_dropout_prob
        self.dropout2 = cfg.attention_probs_dropout_prob

    def forward(
        self,
        vision: torch.Tensor,
        vision_mask: torch.Tensor,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        need_probs: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Returns the text-side context (B, L, bi), the vision-side context (B, N, bi) and, when asked,
        the weights (text->vision (B, h, L, N), vision->text (B, h, N, L))."""
        h = self.heads
        q1, k1, v1 = (split_heads(p(vision), h) for p in (self.query1, self.key1, self.value1))
        q2, k2, v2 = (split_heads(p(text), h) for p in (self.query2, self.key2, self.value2))
        p1 = self.dropout1 if self.training else 0.0
        p2 = self.dropout2 if self.training else 0.0
        text_ctx, text_probs = attend(q2, k1, v1, vision_mask, p1, need_probs)
        vision_ctx, vision_probs = attend(q1, k2, v2, text_mask, p2, need_probs)
        probs = (text_probs, vision_probs) if need_probs else None
        return text_ctx, vision_ctx, probs


class BiOutput(nn.Module):
    """Projects the co-attention contexts back: `dense1`/`LayerNorm1` to the visual stream, `dense2`/
    `LayerNorm2` to the text stream, each with its residual.

    The release also holds `q_dense1`/`q_dense2`, which its forward never uses; conversion drops them."""

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        eps = cfg.layer_norm_eps
        self.dense1 = nn.Linear(cfg.bi_hidden_size, cfg.v_hidden_size)
        self.LayerNorm1 = nn.LayerNorm(cfg.v_hidden_size, eps=eps)
        self.dropout1 = Dropout(cfg.v_hidden_dropout_prob)
        self.dense2 = nn.Linear(cfg.bi_hidden_size, cfg.hidden_size)
        self.LayerNorm2 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.dropout2 = Dropout(cfg.hidden_dropout_prob)

    def forward(
        self, vision_ctx: torch.Tensor, vision: torch.Tensor, text_ctx: torch.Tensor, text: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        vision = self.LayerNorm1(vision + self.dropout1(self.dense1(vision_ctx)))
        text = self.LayerNorm2(text + self.dropout2(self.dense2(text_ctx)))
        return vision, text


class CoAttentionLayer(nn.Module):
    """Co-attention, then a feed-forward block per stream (visual: v_intermediate_size, text:
    intermediate_size, as the release builds them)."""

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        eps = cfg.layer_norm_eps
        self.biattention = BiAttention(cfg)
        self.biOutput = BiOutput(cfg)
        self.v_intermediate = Intermediate(cfg.v_hidden_size, cfg.v_intermediate_size)
        self.v_output = ResidualOutput(
            cfg.v_intermediate_size, cfg.v_hidden_size, cfg.v_hidden_dropout_prob, eps
        )
        self.t_intermediate = Intermediate(cfg.hidden_size, cfg.intermediate_size)
        self.t_output = ResidualOutput(cfg.intermediate_size, cfg.hidden_size, cfg.hidden_dropout_prob, eps)

    def forward(
        self,
        vision: torch.Tensor,
        vision_mask: torch.Tensor,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        need_probs: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        text_ctx, vision_ctx, probs = self.biattention(vision, vision_mask, text, text_mask, need_probs)
        vision, text = self.biOutput(vision_ctx, vision, text_ctx, text)
        vision = self.v_output(self.v_intermediate(vision), vision)
        text = self.t_output(self.t_intermediate(text), text)
        return vision, text, probs


class Encoder(nn.Module):
    """Text layers (`layer`), visual layers (`v_layer`) and co-attention layers (`c_layer`), run in
    `schedule` order."""

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        self.steps = schedule(cfg)
        self.layer = nn.ModuleList(
            Layer(
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.intermediate_size,
                cfg.attention_probs_dropout_prob,
                cfg.hidden_dropout_prob,
                cfg.layer_norm_eps,
            )
            for _ in range(cfg.num_hidden_layers)
        )
        self.v_layer = nn.ModuleList(
            Layer(
                cfg.v_hidden_size,
                cfg.v_num_attention_heads,
                cfg.v_intermediate_size,
                cfg.v_attention_probs_dropout_prob,
                cfg.v_hidden_dropout_prob,
                cfg.layer_norm_eps,
            )
            for _ in range(cfg.v_num_hidden_layers)
        )
        self.c_layer = nn.ModuleList(CoAttentionLayer(cfg) for _ in range(cfg.num_co_layers))

    def forward(
        self,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        vision: torch.Tensor,
        vision_mask: torch.Tensor,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Masks are boolean (B, 1, 1, S), True = attend. Returns both streams and, with
        `output_attentions`, each co-attention layer's weights."""
        co_probs = []
        for kind, i in self.steps:
            if kind == "text":
                text = self.layer[i](text, text_mask)
            elif kind == "vision":
                vision = self.v_layer[i](vision, vision_mask)
            else:
                vision, text, probs = self.c_layer[i](vision, vision_mask, text, text_mask, output_attentions)
                if probs is not None:
                    co_probs.append(probs)
        return text, vision, co_probs
