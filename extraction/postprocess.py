"""Network outputs -> stored records: decode scores and boxes, select the regions, rescale to the image."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from extraction.box_coder import BoxCoder, clip_boxes
from extraction.rcnn import ImageOutputs
from extraction.selection import RULES, SelectionConfig, select
from storage import RegionFeatures


@dataclass
class Decoded:
    """One image's class probabilities (R, C+1) and, when asked for, its class-specific regressed boxes
    (R, C, 4) clipped to the network input."""

    probs: torch.Tensor
    boxes: torch.Tensor | None


def decode(out: ImageOutputs, input_hw: tuple[int, int], coder: BoxCoder, with_boxes: bool) -> Decoded:
    probs = F.softmax(out.cls_logits, dim=-1)
    if not with_boxes:
        return Decoded(probs, None)
    num_classes = out.cls_logits.shape[1] - 1
    boxes = coder.decode(out.deltas, out.proposals).view(-1, num_classes, 4)
    return Decoded(probs, clip_boxes(boxes, *input_hw))


def rescale(boxes: torch.Tensor, input_hw: tuple[int, int], orig_hw: tuple[int, int]) -> torch.Tensor:
    """Boxes in network-input pixels -> original pixels, scaled per axis and clipped (detectron2's
    detector_postprocess)."""
    orig_h, orig_w = orig_hw
    scale = torch.tensor([orig_w / input_hw[1], orig_h / input_hw[0]] * 2, device=boxes.device)
    return clip_boxes(boxes * scale, orig_h, orig_w)


def to_record(
    out: ImageOutputs,
    img_id: str,
    orig_hw: tuple[int, int],
    input_hw: tuple[int, int],
    selection: SelectionConfig,
    coder: BoxCoder,
) -> RegionFeatures:
    """The regions `selection` keeps, with their features, labels and boxes in original pixels."""
    decoded = decode(out, input_hw, coder, RULES[selection.rule].needs_boxes)
    chosen = select(out.proposals, decoded.probs, decoded.boxes, selection)
    # softmax over all A+1 attributes, then the best real one ("no attribute", last, is excluded)
    attrs_conf, attrs_id = F.softmax(out.attr_logits[chosen.index], dim=-1)[:, :-1].max(dim=1)
    orig_h, orig_w = orig_hw
    return RegionFeatures(
        img_id=img_id,
        img_h=int(orig_h),
        img_w=int(orig_w),
        boxes=_numpy(rescale(chosen.boxes, input_hw, orig_hw), np.float32),
        features=_numpy(out.features[chosen.index], np.float32),
        objects_id=_numpy(chosen.classes, np.int64),
        objects_conf=_numpy(chosen.scores, np.float32),
        attrs_id=_numpy(attrs_id, np.int64),
        attrs_conf=_numpy(attrs_conf, np.float32),
    )


def _numpy(x: torch.Tensor, dtype: type) -> np.ndarray:
    return x.cpu().numpy().astype(dtype)
