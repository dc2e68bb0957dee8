"""LXMERT's pre-training heads: masked-LM over the tied word table, object label / attribute / feature."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.tied import TiedWords
from .config import LxmertConfig


class Transform(nn.Module):
    """`LN(gelu(W h))`, the shared first step of the prediction heads."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(x)))


class MaskedLMHead(nn.Module):
    """Vocabulary logits through the word-embedding matrix (tied, passed at call time) plus a bias."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.transform = Transform(cfg)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, x: torch.Tensor, words: torch.Tensor | TiedWords) -> torch.Tensor:
        """`words`: the word-embedding table, or the step's `TiedWords` pairing over it."""
        x = self.transform(x)
        if isinstance(words, TiedWords):
            return words.decode(x, self.bias)
        return F.linear(x, words, self.bias)


class ObjectHead(nn.Module):
    """Per-object detector label, attribute and original-feature predictions."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.transform = Transform(cfg)
        self.obj = nn.Linear(cfg.hidden_size, cfg.num_object_labels)
        self.attr = nn.Linear(cfg.hidden_size, cfg.num_attr_labels)
        self.feat = nn.Linear(cfg.hidden_size, cfg.visual_feat_dim)
