"""Box predictor with the bottom-up-attention attribute head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class AttributePredictor(nn.Module):
    """A region feature -> class logits (C+1, background last), class-specific deltas (4C), attributes.

    The attribute head embeds the argmax over all C+1 logits (background included, as the released
    model was trained), concatenates it with the feature and scores A+1 attributes ("none" last).
    """

    def __init__(
        self,
        in_dim: int = 2048,
        num_classes: int = 1600,
        num_attributes: int = 400,
        embed_dim: int = 256,
        hidden_dim: int = 512,
    ):
        super().__init__()
        self.cls_score = nn.Linear(in_dim, num_classes + 1)
        self.bbox_pred = nn.Linear(in_dim, num_classes * 4)
        self.cls_embedding = nn.Embedding(num_classes + 1, embed_dim)
        self.fc_attr = nn.Linear(in_dim + embed_dim, hidden_dim)
        self.attr_score = nn.Linear(hidden_dim, num_attributes + 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = self.cls_score(x)
        deltas = self.bbox_pred(x)
        emb = self.cls_embedding(scores.argmax(dim=-1))
        attr = self.attr_score(F.relu(self.fc_attr(torch.cat([x, emb.to(x.dtype)], dim=-1))))
        return scores, deltas, attr
