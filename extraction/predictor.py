"""Box predictor with the bottom-up-attention attribute head, and the attribute head's training loss."""

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
        return scores, deltas, self.attributes(x, scores.argmax(dim=-1))

    def attributes(self, x: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """Attribute logits (R, A+1) of features `x` given each region's class (the predicted class at
        test time, the ground-truth class in training)."""
        emb = self.cls_embedding(classes)
        return self.attr_score(F.relu(self.fc_attr(torch.cat([x, emb.to(x.dtype)], dim=-1))))


def attribute_loss(logits: torch.Tensor, labels: torch.Tensor, weight: float) -> torch.Tensor:
    """The attribute head's loss over foreground regions, as bottom-up attention trains it.

    Source: peteanderson80/bottom-up-attention `models/vg/ResNet-101/faster_rcnn_end2end_final/
    train.prototxt` (`loss_attr`: SoftmaxWithLoss over the 401 attribute logits of the foreground RoIs,
    `ignore_label: -1`, `normalization: VALID`, `loss_weight: 0.5`; the class embedding is looked up from
    the ground-truth labels) and MILVLG/bottom-up-attention.pytorch (`AttributePredictor.loss`), which
    spells out the multi-label case: each region carries up to 16 attribute ids padded with -1; its
    softmax cross-entropy is taken once per id and averaged over its ids, summed over regions and divided
    by the number of regions with at least one attribute; regions without attributes add nothing. The
    weight is the Caffe release's 0.5 by default (MILVLG and grid-feats-vqa use 0.2).

    logits (R, A+1); labels (R, K) int64, attribute ids in 0..A-1, -1 padding."""
    if labels.numel() == 0:
        return logits.sum() * 0.0
    counts = (labels >= 0).sum(dim=1)
    valid_regions = int((counts > 0).sum())
    if valid_regions == 0:
        return logits.sum() * 0.0
    k = labels.shape[1]
    per_id = F.cross_entropy(
        logits.repeat_interleave(k, dim=0), labels.reshape(-1), reduction="none", ignore_index=-1
    ).view(-1, k)
    per_region = per_id.sum(dim=1) / counts.clamp(min=1)
    return per_region.sum() * weight / valid_regions
