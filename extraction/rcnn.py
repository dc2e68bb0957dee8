"""The whole network with detectron2's module names (backbone, proposal_generator, roi_heads) and its
forward: a normalised, zero-padded batch -> each image's proposals and their RoI outputs."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from extraction.backbone import ResNetC4
from extraction.config import DetectorConfig
from extraction.roi_heads import Res5ROIHeads
from extraction.rpn import RPN

RANDOM_SEED = 0
Sizes = list[tuple[int, int]]
StageTimer = Callable[[str], contextlib.AbstractContextManager]
NETWORK_STAGES = ("backbone", "rpn", "roi_head")


@dataclass
class ImageOutputs:
    """One image's proposals (network-input pixels) and per-proposal network outputs, all float32."""

    proposals: torch.Tensor  # (R, 4) x1, y1, x2, y2
    objectness: torch.Tensor  # (R,) RPN logits
    features: torch.Tensor  # (R, feature_dim) mean-pooled res5
    cls_logits: torch.Tensor  # (R, C+1), background last
    deltas: torch.Tensor  # (R, 4C) class-specific box deltas relative to the proposals
    attr_logits: torch.Tensor  # (R, A+1), "no attribute" last


def _untimed(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class VGFasterRCNN(nn.Module):
    """Faster R-CNN ResNet-C4 with the attribute head; `state_dict()` matches detectron2's names."""

    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        self.dtype = cfg.dtype
        self.backbone = ResNetC4(
            cfg.blocks_per_stage, cfg.stem_channels, cfg.res2_channels, cfg.bottleneck_channels
        )
        self.proposal_generator = RPN(
            self.backbone.out_channels,
            cfg.rpn_channels,
            cfg.anchor_sizes,
            cfg.anchor_ratios,
            cfg.pre_nms_topk,
            cfg.post_nms_topk,
            cfg.rpn_nms_thresh,
        )
        res4 = self.backbone.out_channels
        self.roi_heads = Res5ROIHeads(
            res4,
            res4 * 2,
            cfg.bottleneck_channels * 8,
            cfg.res5_blocks,
            cfg.pooler_resolution,
            cfg.res5_dilation,
            cfg.num_classes,
            cfg.num_attributes,
            cfg.attr_embed_dim,
            cfg.attr_hidden_dim,
        )

    @property
    def feature_dim(self) -> int:
        """Width of a region feature (res5's output channels)."""
        return self.roi_heads.out_channels

    def forward(self, images: torch.Tensor, sizes: Sizes, stage: StageTimer = _untimed) -> list[ImageOutputs]:
        """images (N, 3, H, W) normalised and zero-padded; sizes: each image's (h, w) inside the batch.

        `stage(name)` wraps each of NETWORK_STAGES (the detector times them with it).
        """
        with self._autocast(images.device):
            with stage("backbone"):
                features = self.backbone(images, sizes)
            with stage("rpn"):
                proposals = self.proposal_generator(features, self.backbone.output_sizes(sizes), sizes)
            with stage("roi_head"):
                heads = self.roi_heads(features, [boxes for boxes, _ in proposals])
        return [
            ImageOutputs(boxes, logits, out.features, out.cls_logits, out.deltas, out.attr_logits)
            for (boxes, logits), out in zip(proposals, heads, strict=True)
        ]

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=getattr(torch, self.dtype))


@torch.no_grad()
def init_random_weights(model: VGFasterRCNN, seed: int = RANDOM_SEED) -> None:
    """Fill every parameter from a fixed-seed CPU generator: the same weights in every process.

    Convolutions get c2_msra (He, fan-out) init and the last conv of each residual branch a small
    FrozenBN scale, so activations stay O(1) through 101 layers; predictors get small normal weights.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            fan_out = module.out_channels * module.kernel_size[0] * module.kernel_size[1]
            std = 0.01 if name.startswith("proposal_generator") else math.sqrt(2.0 / fan_out)
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            if module.bias is not None:
                module.bias.zero_()
            if name.endswith("conv3"):
                module.norm.weight.fill_(0.2)
        elif isinstance(module, nn.Linear):
            std = 0.001 if name.endswith("bbox_pred") else 0.01
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen))
