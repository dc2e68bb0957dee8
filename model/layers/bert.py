"""BERT's post-LN encoder and masked-LM head under BERT's own module names, for one-stream families.

VisualBERT and VL-BERT run text and regions through one such encoder. Keeping BERT's names (separate
`query`/`key`/`value`, `attention.output.LayerNorm`, ...) lets transformers' VisualBERT directories and the
VL-BERT release load key for key, which is why this is not `attention.MultiHeadAttention`.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .attention import static_layout_on
from .dropout import Dropout


class BertSizes(Protocol):
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_dropout_prob: float
    attention_probs_dropout_prob: float
    layer_norm_eps: float


class SelfAttention(nn.Module):
    """Multi-head scaled dot-product attention over one sequence; `mask` (B, 1, 1, S), True = key."""

    def __init__(self, cfg: BertSizes):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.dropout_p = cfg.attention_probs_dropout_prob
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, output_attentions: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, -1).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        p = self.dropout_p if self.training else 0.0
        probs = None
        if output_attentions:
            # SDPA does not return its weights; compute them explicitly when asked for.
            scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = scores.softmax(dim=-1)
            context = F.dropout(probs, p, self.training) @ v
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        return context.transpose(1, 2).reshape(b, s, -1), probs


class SelfOutput(nn.Module):
    """`LN(x + dropout(W h))`."""

    def __init__(self, cfg: BertSizes, in_dim: int):
        super().__init__()
        self.dense = nn.Linear(in_dim, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(residual + self.dropout(self.dense(h)))


class Attention(nn.Module):
    def __init__(self, cfg: BertSizes):
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = SelfOutput(cfg, cfg.hidden_size)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, output_attentions: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        context, probs = self.self(x, mask, output_attentions)
        return self.output(context, x), probs


class Intermediate(nn.Module):
    """`gelu(W x)` with the exact (erf) GELU."""

    def __init__(self, cfg: BertSizes):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class Layer(nn.Module):
    """Self-attention then feed-forward, each with a residual and a LayerNorm after it."""

    def __init__(self, cfg: BertSizes):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = SelfOutput(cfg, cfg.intermediate_size)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, output_attentions: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, probs = self.attention(x, mask, output_attentions)
        return self.output(self.intermediate(x), x), probs


class BertEncoder(nn.Module):
    """`num_hidden_layers` layers; returns the last states and, on request, each layer's weights."""

    def __init__(self, cfg: BertSizes):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(
        self, x: torch.Tensor, key_mask: torch.Tensor | None, output_attentions: bool = False
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
        """x (B, S, H); key_mask (B, S), 1 = real position (padding is never attended to)."""
        # the static layout (a compiled step) keeps even an all-real mask rather than ask the device
        everywhere = key_mask is None or (not static_layout_on() and bool(key_mask.all()))
        mask = None if everywhere else key_mask.bool()[:, None, None, :]
        attentions = []
        for layer in self.layer:
            x, probs = layer(x, mask, output_attentions)
            attentions.append(probs)
        return x, tuple(attentions) if output_attentions else None


class PredictionTransform(nn.Module):
    """`LN(gelu(W h))`: the first step of BERT's masked-LM head."""

    def __init__(self, cfg: BertSizes):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class MaskedLMPredictions(nn.Module):
    """Vocabulary logits: transform, then the word-embedding table (tied, passed at call time) plus a bias."""

    def __init__(self, cfg: BertSizes, vocab_size: int):
        super().__init__()
        self.transform = PredictionTransform(cfg)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        return F.linear(self.transform(x), words, self.bias)
