"""ViLBERT inputs: BERT text embeddings and region embeddings with a 5-d location and a global image token."""

from __future__ import annotations

import torch
from torch import nn

from model.layers.dropout import Dropout

from .config import VilbertConfig

# The global image token sits at the whole image: (x1, y1, x2, y2, area) = (0, 0, 1, 1, 1).
MASKED_OVERLAP_IOU = 0.4  # pre-training: regions overlapping a masked one this much leave the global mean
GLOBAL_LOCATION = (0.0, 0.0, 1.0, 1.0, 1.0)


class TextEmbeddings(nn.Module):
    """word + position + token type -> LN -> dropout, with vilbert-multi-task's optional task token.

    With `config.task_token` set, that row of `task_embeddings` is inserted after [CLS] with no position
    or type added (as the release does); the backbone drops its output again so callers keep (B, L).
    """

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        if cfg.task_vocab_size:
            self.task_embeddings = nn.Embedding(cfg.task_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.hidden_dropout_prob)
        self.task_token = cfg.task_token

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, L) ids -> (B, L, H), or (B, L + 1, H) with the task token after position 0."""
        words = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        length = input_ids.shape[1]
        if length > self.position_embeddings.num_embeddings:
            raise ValueError(
                f"text of {length} tokens is longer than max_position_embeddings "
                f"{self.position_embeddings.num_embeddings}; truncate it"
            )
        x = words + self.token_type_embeddings(token_type_ids) + self.position_embeddings.weight[:length]
        if self.task_token is not None:
            task = self.task_embeddings.weight[self.task_token].expand(x.shape[0], 1, -1)
            x = torch.cat([x[:, :1], task, x[:, 1:]], dim=1)
        return self.dropout(self.LayerNorm(x))


class ImageEmbeddings(nn.Module):
    """`LN(W_f f + W_l loc)` -> dropout, over the global token and the regions."""

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        self.image_embeddings = nn.Linear(cfg.visual_feat_dim, cfg.v_hidden_size)
        self.image_location_embeddings = nn.Linear(cfg.num_locs, cfg.v_hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.v_hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.v_hidden_dropout_prob)

    def forward(self, features: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
        x = self.image_embeddings(features) + self.image_location_embeddings(locations)
        return self.dropout(self.LayerNorm(x))


def with_global_region(
    features: torch.Tensor,
    boxes: torch.Tensor,
    mask: torch.Tensor | None,
    image_feats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Regions as ViLBERT reads them: the global token first, every box as (x1, y1, x2, y2, area).

    features (B, N, D), boxes (B, N, 4) normalised to [0, 1], mask (B, N) 1 = real region; image_feats
    (B, D) the global token's feature (default: the mean of the real regions).
    Returns features (B, N + 1, D) with the global token's in row 0, locations (B, N + 1, 5)
    and mask (B, N + 1) with the global token real. Padding regions are left as given: the mask keeps
    them out of every attention.
    """
    b, n, _ = features.shape
    real = features.new_ones(b, n) if mask is None else mask.to(features.dtype)
    if image_feats is None:
        mean = (features * real[..., None]).sum(1) / real.sum(1, keepdim=True).clamp(min=1)
    else:
        mean = image_feats.to(features.dtype)
    area = (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])
    locations = torch.cat([boxes, area[..., None]], dim=-1).to(features.dtype)
    whole = features.new_tensor(GLOBAL_LOCATION).expand(b, 1, -1)
    return (
        torch.cat([mean[:, None], features], dim=1),
        torch.cat([whole, locations], dim=1),
        torch.cat([real.new_ones(b, 1), real], dim=1),
    )


def box_iou(boxes: torch.Tensor) -> torch.Tensor:
    """(B, N, 4) boxes (x1, y1, x2, y2) -> (B, N, N) pairwise IoU (0 where a union is empty)."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    area = (x2 - x1).clamp(min=0) * (y2 - y1).clamp(min=0)
    w = torch.minimum(x2[..., :, None], x2[..., None, :]) - torch.maximum(x1[..., :, None], x1[..., None, :])
    h = torch.minimum(y2[..., :, None], y2[..., None, :]) - torch.maximum(y1[..., :, None], y1[..., None, :])
    inter = w.clamp(min=0) * h.clamp(min=0)
    union = area[..., :, None] + area[..., None, :] - inter
    return torch.where(union > 0, inter / union.clamp(min=1e-12), torch.zeros_like(inter))


def pretraining_image_feats(
    features: torch.Tensor,
    boxes: torch.Tensor,
    mask: torch.Tensor | None,
    region_mask: torch.Tensor,
    iou_threshold: float = MASKED_OVERLAP_IOU,
) -> torch.Tensor:
    """The global token's feature in pre-training, as vilbert-multi-task's loader computes it: the sum of
    the regions' features as fed (masked ones mostly zeroed) over the number of real regions that overlap
    no masked region by IoU > `iou_threshold` (a masked region overlaps itself), at least 1. Boxes are
    normalised here, the release's in pixels with its +1 widths: the same IoU up to that pixel."""
    b, n, _ = features.shape
    real = features.new_ones(b, n, dtype=torch.bool) if mask is None else mask.bool()
    masked = region_mask.bool() & real
    near_masked = ((box_iou(boxes.float()) > iou_threshold) & masked[:, None, :]).any(-1)
    count = (real & ~near_masked).sum(1, keepdim=True).clamp(min=1)
    return (features * real[..., None]).sum(1) / count.to(features.dtype)
