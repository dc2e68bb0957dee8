"""Additive attention over a padded set of region (or grid-cell) features."""

from __future__ import annotations

import torch
from torch import nn


class AdditiveAttention(nn.Module):
    """`α = softmax_i(wᵀ tanh(W_v v_i + W_q q))` over the real regions only."""

    def __init__(self, feature_dim: int, query_dim: int, attention_size: int):
        super().__init__()
        self.key = nn.Linear(feature_dim, attention_size)
        self.query = nn.Linear(query_dim, attention_size)
        self.score = nn.Linear(attention_size, 1)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """(B, N, D) → (B, N, A); computed once per image, reused every step."""
        return self.key(features)

    def forward(self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """query (B, Q), keys (B, N, A), mask (B, N) with 1 = real region → α (B, N) summing to 1."""
        scores = self.score(torch.tanh(keys + self.query(query).unsqueeze(1))).squeeze(-1)
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1)
