"""Output heads: pooler, masked-LM, object/attribute/feature prediction, and the MLP classifier head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import LxmertConfig
from .tied import TiedWords


class Pooler(nn.Module):
    """`tanh(W h[CLS])`."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, lang: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(lang[:, 0]))


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


class ClassifierHead(nn.Module):
    """`Linear(in, hidden) -> GELU -> LN -> Linear(hidden, out)`: the QA answer and NLVR2 pair head."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_dim, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.classifier = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(F.gelu(self.dense(x))))
