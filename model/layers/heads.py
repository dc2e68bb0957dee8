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


def soft_score_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """VQA/GQA: BCE-with-logits against soft answer scores (B, A), mean x A, as the LXMERT release trains."""
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype)) * logits.shape[-1]


def check_image_pairs(visual_feats: torch.Tensor | None) -> None:
    """NLVR2 inputs hold two images per sentence: visual_feats (B, 2, N, D)."""
    if visual_feats is None or visual_feats.dim() != 4 or visual_feats.shape[1] != 2:
        shape = None if visual_feats is None else tuple(visual_feats.shape)
        raise ValueError(f"NLVR2 expects visual_feats of shape (B, 2, N, D), got {shape}")


def each_sentence_twice(x: torch.Tensor | None) -> torch.Tensor | None:
    """Row 2i pairs sentence i with img0, row 2i+1 with img1."""
    return None if x is None else x.repeat_interleave(2, dim=0)


def image_rows(x: torch.Tensor | None) -> torch.Tensor | None:
    """(B, 2, ...) -> (2B, ...), in the order of `each_sentence_twice`."""
    return None if x is None else x.flatten(0, 1)
