"""Res5 ROI head: RoIPool 14x14 on res4, the dilated stride-1 res5 stage, mean pool, predictor."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchvision.ops import RoIPool

from extraction.backbone import make_stage
from extraction.predictor import AttributePredictor


@dataclass
class RoIOutputs:
    """Per-proposal outputs of one image, all float32."""

    features: torch.Tensor  # (R, out_channels) mean-pooled res5
    cls_logits: torch.Tensor  # (R, C+1)
    deltas: torch.Tensor  # (R, 4C)
    attr_logits: torch.Tensor  # (R, A+1)


class Res5ROIHeads(nn.Module):
    """Pooled res4 regions -> res5 -> (R, out_channels) features and the predictor's outputs."""

    def __init__(
        self,
        in_channels: int = 1024,
        out_channels: int = 2048,
        bottleneck_channels: int = 512,
        num_blocks: int = 3,
        pooler_resolution: int = 14,
        dilation: int = 2,
        num_classes: int = 1600,
        num_attributes: int = 400,
        attr_embed_dim: int = 256,
        attr_hidden_dim: int = 512,
    ):
        super().__init__()
        self.pooler = RoIPool((pooler_resolution, pooler_resolution), spatial_scale=1.0 / 16)
        # stride 1 with dilation 2 keeps res5 at 14x14, as in the caffe model
        self.res5 = make_stage(
            num_blocks, in_channels, out_channels, bottleneck_channels, first_stride=1, dilation=dilation
        )
        self.out_channels = out_channels
        self.box_predictor = AttributePredictor(
            out_channels, num_classes, num_attributes, attr_embed_dim, attr_hidden_dim
        )

    def forward(self, features: torch.Tensor, proposals: list[torch.Tensor]) -> list[RoIOutputs]:
        """features (N, in_channels, H, W) with padding zeroed; proposals: (R_i, 4) boxes per image."""
        out = []
        # one image at a time: bounded memory, and per-image results independent of the batch
        for i, boxes in enumerate(proposals):
            rois = torch.cat([boxes.new_full((boxes.shape[0], 1), 0.0), boxes], dim=1)
            # pooled in float32: box coordinates lose pixels in fp16, and max-pooling is exact anyway
            x = self.pooler(features[i : i + 1].float(), rois.float())
            x = self.res5(x).mean(dim=(2, 3))
            cls_logits, deltas, attr_logits = self.box_predictor(x)
            out.append(RoIOutputs(x.float(), cls_logits.float(), deltas.float(), attr_logits.float()))
        return out
