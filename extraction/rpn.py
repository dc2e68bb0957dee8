"""Region proposal network: 3x3 conv head on res4 and detectron2's test-time proposal filtering."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import nms

from extraction.anchors import AnchorGenerator
from extraction.box_coder import BoxCoder, clip_boxes, nonempty


class RPNHead(nn.Module):
    """conv 3x3 + ReLU, then per-anchor objectness logits and box deltas."""

    def __init__(self, in_ch: int, conv_ch: int, num_anchors: int):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, conv_ch, kernel_size=3, stride=1, padding=1)
        self.objectness_logits = nn.Conv2d(conv_ch, num_anchors, kernel_size=1)
        self.anchor_deltas = nn.Conv2d(conv_ch, num_anchors * 4, kernel_size=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = F.relu(self.conv(x))
        return self.objectness_logits(t), self.anchor_deltas(t)


class RPN(nn.Module):
    """Proposals per image: top-k logits -> decode -> clip -> drop empty -> NMS -> top-k."""

    def __init__(
        self,
        in_ch: int,
        conv_ch: int,
        anchor_sizes: tuple[float, ...],
        anchor_ratios: tuple[float, ...],
        pre_nms_topk: int,
        post_nms_topk: int,
        nms_thresh: float,
    ):
        super().__init__()
        self.anchor_generator = AnchorGenerator(anchor_sizes, anchor_ratios)
        self.rpn_head = RPNHead(in_ch, conv_ch, self.anchor_generator.num_anchors)
        self.box_coder = BoxCoder((1.0, 1.0, 1.0, 1.0))
        self.pre_nms_topk = pre_nms_topk
        self.post_nms_topk = post_nms_topk
        self.nms_thresh = nms_thresh

    def forward(self, features: torch.Tensor, image_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's res4 map (1, C, h, w) -> (proposal boxes (R, 4) in input pixels, objectness (R,))."""
        # the head's weights are plain NCHW (a layout mixed with channels-last inputs runs slowest)
        logits, deltas = self.rpn_head(features.contiguous())
        num_anchors = self.anchor_generator.num_anchors
        fh, fw = features.shape[-2:]
        # flattened (y, x, anchor) as detectron2 does
        scores = logits[0].permute(1, 2, 0).reshape(-1).float()
        d = deltas[0].reshape(num_anchors, 4, fh, fw).permute(2, 3, 0, 1).reshape(-1, 4)
        scores, idx = scores.topk(min(self.pre_nms_topk, scores.numel()))
        anchors = self.anchor_generator(fh, fw)
        boxes = self.box_coder.decode(d[idx], anchors[idx])
        finite = torch.isfinite(boxes).all(dim=1) & torch.isfinite(scores)
        boxes, scores = boxes[finite], scores[finite]
        boxes = clip_boxes(boxes, *image_hw)
        keep = nonempty(boxes)
        boxes, scores = boxes[keep], scores[keep]
        keep = nms(boxes, scores, self.nms_thresh)[: self.post_nms_topk]
        return boxes[keep], scores[keep]
