"""The whole network with detectron2's module names: backbone, proposal_generator, roi_heads."""

from __future__ import annotations

import math

import torch
from torch import nn

from extraction.backbone import ResNetC4
from extraction.config import DetectorConfig
from extraction.roi_heads import Res5ROIHeads
from extraction.rpn import RPN

RANDOM_SEED = 0


class VGFasterRCNN(nn.Module):
    """Faster R-CNN R101-C4 with the attribute head; `state_dict()` matches detectron2's names."""

    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        self.backbone = ResNetC4(cfg.blocks_per_stage)
        self.proposal_generator = RPN(
            self.backbone.out_channels,
            cfg.rpn_channels,
            cfg.anchor_sizes,
            cfg.anchor_ratios,
            cfg.pre_nms_topk,
            cfg.post_nms_topk,
            cfg.rpn_nms_thresh,
        )
        self.roi_heads = Res5ROIHeads(
            cfg.pooler_resolution,
            cfg.res5_dilation,
            cfg.num_classes,
            cfg.num_attributes,
            cfg.attr_embed_dim,
            cfg.attr_hidden_dim,
        )


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
