"""Res5 ROI head: RoIPool 14x14 on res4, the dilated stride-1 res5 stage, mean pool, predictor; in
training, detectron2's proposal labelling (ground truth appended, IoU >= 0.5 foreground), RoI sampling and
the Fast R-CNN and attribute losses."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import RoIPool, box_iou

from extraction.backbone import make_stage
from extraction.box_coder import BoxCoder
from extraction.predictor import AttributePredictor, attribute_loss
from extraction.sampling import Matcher, subsample_labels


@dataclass
class RoIOutputs:
    """Per-proposal outputs of one image, all float32."""

    features: torch.Tensor  # (R, out_channels) mean-pooled res5
    cls_logits: torch.Tensor  # (R, C+1)
    deltas: torch.Tensor  # (R, 4C)
    attr_logits: torch.Tensor  # (R, A+1)


@dataclass
class SampledRoIs:
    """One image's sampled training RoIs and their targets."""

    boxes: torch.Tensor  # (S, 4) proposals (ground-truth boxes among them), input pixels
    classes: torch.Tensor  # (S,) int64, 0..C-1 foreground, C background
    matched_boxes: torch.Tensor  # (S, 4) the ground-truth box each RoI matched (zeros without any)
    attributes: torch.Tensor  # (S, K) int64 attribute ids of the matched box, -1 padding


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
        self.memory_format = torch.channels_last  # res5's input layout (backbone.conv_memory_format)
        self.box_predictor = AttributePredictor(
            out_channels, num_classes, num_attributes, attr_embed_dim, attr_hidden_dim
        )

    @property
    def num_classes(self) -> int:
        return self.box_predictor.cls_score.out_features - 1

    def forward(self, features: torch.Tensor, boxes: torch.Tensor) -> RoIOutputs:
        """One image's res4 map (1, C, H, W) and its proposals (R, 4) in input pixels."""
        x = self.pooled_features([features], [boxes])
        # the predictor is ~1 % of the work: float32 keeps labels and box deltas at full precision
        with torch.autocast(x.device.type, enabled=False):
            cls_logits, deltas, attr_logits = self.box_predictor(x)
        return RoIOutputs(x, cls_logits, deltas, attr_logits)

    def forward_padded(self, features: torch.Tensor, boxes: torch.Tensor) -> RoIOutputs:
        """A canvas batch's res4 maps (B, C, H, W) and each slot's boxes (B, R, 4) -> outputs (B, R, ...):
        one pool and one res5 call of B x R RoIs. Pooling the canvas equals pooling each image's own map:
        beyond an image the canvas holds masked zeros and res4 is a ReLU output (>= 0), so a bin's
        maximum is the one over the image's positions (0 for a bin wholly outside, as RoIPool gives)."""
        b, r = boxes.shape[:2]
        slots = torch.arange(b, dtype=torch.float32, device=boxes.device)[:, None, None].expand(b, r, 1)
        rois = torch.cat([slots, boxes.float()], 2).view(-1, 5)
        x = self.pooler(features.float().contiguous(), rois)
        x = self.res5(x.contiguous(memory_format=self.memory_format)).mean(dim=(2, 3), dtype=torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            cls_logits, deltas, attr_logits = self.box_predictor(x)
        return RoIOutputs(*(t.view(b, r, -1) for t in (x, cls_logits, deltas, attr_logits)))

    def pooled_features(self, features: list[torch.Tensor], boxes: list[torch.Tensor]) -> torch.Tensor:
        """Images' res4 maps (each (1, C, H, W)) and their boxes -> (sum R, out_channels), images in order."""
        # pooled in float32 (box coordinates lose pixels in fp16, and max-pooling is exact anyway) from an
        # NCHW copy of the small res4 map: RoIPool reads channels-last several times slower
        pooled = []
        for f, b in zip(features, boxes, strict=True):
            rois = torch.cat([b.new_zeros((b.shape[0], 1)), b], dim=1)
            pooled.append(self.pooler(f.float().contiguous(), rois.float()))
        x = torch.cat(pooled) if len(pooled) > 1 else pooled[0]
        return self.res5(x.contiguous(memory_format=self.memory_format)).mean(dim=(2, 3), dtype=torch.float32)

    def sample_proposals(
        self,
        proposals: torch.Tensor,
        gt_boxes: torch.Tensor,
        gt_classes: torch.Tensor,
        gt_attributes: torch.Tensor,
        matcher: Matcher,
        batch_size: int,
        positive_fraction: float,
        generator: torch.Generator | None = None,
    ) -> SampledRoIs:
        """detectron2's label_and_sample_proposals for one image: the ground-truth boxes are appended to the
        proposals, each is matched (IoU >= threshold: the box's class, else background = C) and at most
        `batch_size` are sampled, at most `positive_fraction` of them foreground."""
        num_classes = self.num_classes
        boxes = torch.cat([proposals.detach(), gt_boxes])
        matches, labels = matcher(box_iou(gt_boxes, boxes))
        if gt_boxes.numel():
            classes = gt_classes[matches].clone()
            classes[labels == 0] = num_classes
            classes[labels == -1] = -1
        else:
            classes = torch.full_like(matches, num_classes)
        pos, neg = subsample_labels(classes, batch_size, positive_fraction, num_classes, generator)
        keep = torch.cat([pos, neg])
        if gt_boxes.numel():
            matched, attrs = gt_boxes[matches[keep]], gt_attributes[matches[keep]]
        else:
            matched = torch.zeros_like(boxes[keep])
            attrs = torch.full((keep.numel(), max(gt_attributes.shape[1], 1)), -1, dtype=torch.int64)
            attrs = attrs.to(boxes.device)
        return SampledRoIs(boxes[keep], classes[keep], matched, attrs)

    def losses(
        self,
        features: list[torch.Tensor],
        sampled: list[SampledRoIs],
        box_coder: BoxCoder,
        attr_loss_weight: float,
    ) -> dict[str, torch.Tensor]:
        """The Fast R-CNN losses as detectron2 computes them over a batch (class cross-entropy averaged over
        every sampled RoI; class-specific L1 on the foreground deltas summed and divided by the number of
        sampled RoIs) and the attribute loss (`attribute_loss`) on the foreground RoIs."""
        x = self.pooled_features(features, [s.boxes for s in sampled])
        with torch.autocast(x.device.type, enabled=False):
            predictor = self.box_predictor
            cls_logits, deltas = predictor.cls_score(x), predictor.bbox_pred(x)
            classes = torch.cat([s.classes for s in sampled])
            boxes = torch.cat([s.boxes for s in sampled])
            matched = torch.cat([s.matched_boxes for s in sampled])
            width = max(s.attributes.shape[1] for s in sampled)
            attrs = torch.cat(
                [F.pad(s.attributes, (0, width - s.attributes.shape[1]), value=-1) for s in sampled]
            )
            num_classes = self.num_classes
            loss_cls = F.cross_entropy(cls_logits, classes, reduction="mean")
            fg = torch.nonzero((classes >= 0) & (classes < num_classes)).squeeze(1)
            fg_deltas = deltas.view(-1, num_classes, 4)[fg, classes[fg]]
            targets = box_coder.encode(boxes[fg], matched[fg])
            loss_box = F.l1_loss(fg_deltas, targets, reduction="sum") / max(classes.numel(), 1)
            attr_logits = predictor.attributes(x[fg], classes[fg])
            loss_attr = attribute_loss(attr_logits, attrs[fg], attr_loss_weight)
        return {"loss_cls": loss_cls, "loss_box_reg": loss_box, "loss_attr": loss_attr}
