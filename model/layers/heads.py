"""Heads any family can put on a transformer: the [CLS] pooler and the two-layer MLP classifier."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Pooler(nn.Module):
    """`tanh(W h[CLS])` over (B, L, H) states."""

    def __init__(self, hidden: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(states[:, 0]))


class ClassifierHead(nn.Module):
    """`Linear(in, hidden) -> GELU -> LN -> Linear(hidden, out)`: answer and image-pair classifiers."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(in_dim, hidden)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.classifier = nn.Linear(hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(F.gelu(self.dense(x))))
