"""Choosing the regions to keep from the scored proposals: the caffe, maxnms and threshold rules.

All rules take one image's proposals (R, 4), class probabilities (R, C+1) with background last and,
for maxnms/threshold, the class-specific regressed boxes (R, C, 4), all in network-input pixels.
NMS is torchvision's (detectron2's IoU, no "+1"). Fewer than `min_boxes` regions are returned as they
are when the image does not have more; nothing is padded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torchvision.ops import batched_nms, nms

CAFFE_FLOORS = (0.05, 0.01, 0.0)


@dataclass(frozen=True)
class SelectionConfig:
    """Which regions of the proposals are kept: `rule` names a row of RULES."""

    RANGES: ClassVar[dict[str, str]] = {
        "min_boxes": "[0, 4096]",
        "max_boxes": "[1, 4096]",
        "conf_thresh": "[0, 1]",
        "nms_thresh": "[0, 1]",
        "score_thresh": "[0, 1]",
        "maxnms_thresholds": "[0, 1]",
    }

    rule: str = "caffe"
    min_boxes: int = 36
    max_boxes: int = 36
    conf_thresh: float = 0.2  # caffe: keep proposals whose max_conf reaches this
    nms_thresh: float = 0.3  # caffe and threshold: per-class NMS IoU
    score_thresh: float = 0.2  # threshold: per-class score threshold
    maxnms_thresholds: tuple[float, ...] = field(default=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9))
    class_probs: bool = False  # keep each kept region's class distribution (all classes, float16 in a store)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"selection rule must be one of {tuple(RULES)}, got {self.rule!r}")
        if not 0 <= self.min_boxes <= self.max_boxes or self.max_boxes < 1:
            raise ValueError(
                f"need 0 <= min_boxes <= max_boxes and max_boxes >= 1; got {self.min_boxes}/{self.max_boxes}"
            )


@dataclass
class Selection:
    """The kept regions: proposal index (its pooled feature), box, foreground class and its probability."""

    index: torch.Tensor  # (N,) int64 into the proposals
    boxes: torch.Tensor  # (N, 4) float32
    classes: torch.Tensor  # (N,) int64 in 0..C-1
    scores: torch.Tensor  # (N,) float32


def per_class_max_conf(
    boxes: torch.Tensor, fg: torch.Tensor, nms_thresh: float, floor: float = 0.0
) -> torch.Tensor:
    """For each box, the best p(c) over the classes c whose NMS (all boxes, scored by p(c)) kept it.

    Only pairs with p(c) >= `floor` take part: a lower-scored box never suppresses a higher one, so
    the result is exact for every box whose max_conf reaches `floor`; the others get 0. Every class's
    NMS runs in one `batched_nms` call, equal to one `nms` per class.
    """
    rows, cols = torch.nonzero(fg >= floor, as_tuple=True)
    scores = fg[rows, cols]
    # ranks instead of scores: tied scores then keep the lower proposal first on every device, as a
    # stable per-class sort would (CUDA's sort is not stable)
    order = scores.argsort(descending=True, stable=True)
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = torch.arange(order.numel(), 0, -1, dtype=torch.float64, device=fg.device)
    # float64: batched_nms offsets each class's boxes by class x image size; in float32 that shift
    # rounds the coordinates (to 1/8 px at 1600 classes) and moves IoUs near the threshold
    keep = batched_nms(boxes[rows].double(), ranks, cols, nms_thresh)
    max_conf = fg.new_zeros(fg.shape[0])
    return max_conf.scatter_reduce(0, rows[keep], scores[keep], reduce="amax")


def select_caffe(proposals: torch.Tensor, probs: torch.Tensor, cfg: SelectionConfig) -> Selection:
    """bottom-up-attention generate_tsv: per-class NMS over the unregressed proposals, keep by max_conf.

    Boxes are the proposals; classes/scores are each proposal's best foreground class. As in the
    reference, the kept set is in proposal order unless it had to be clamped to [min, max] boxes,
    which happens in max_conf order.
    """
    fg = probs[:, :-1]
    # NMS over every (proposal, class) pair is costly; pairs below a floor cannot change the boxes kept
    # as long as enough boxes reach it, so the floor is lowered only when needed
    for floor in sorted({cfg.conf_thresh, *(f for f in CAFFE_FLOORS if f < cfg.conf_thresh)}, reverse=True):
        max_conf = per_class_max_conf(proposals, fg, cfg.nms_thresh, floor)
        passing = int((max_conf >= cfg.conf_thresh).sum())
        if floor == 0 or passing >= cfg.min_boxes or int((max_conf >= floor).sum()) >= cfg.min_boxes:
            break
    keep = torch.nonzero(max_conf >= cfg.conf_thresh).flatten()
    if keep.numel() < cfg.min_boxes or keep.numel() > cfg.max_boxes:
        by_conf = max_conf.argsort(descending=True, stable=True)
        keep = by_conf[: cfg.min_boxes] if keep.numel() < cfg.min_boxes else by_conf[: cfg.max_boxes]
    scores, classes = fg[keep].max(dim=1)
    return Selection(keep, proposals[keep], classes, scores)


def select_maxnms(probs: torch.Tensor, pred_boxes: torch.Tensor, cfg: SelectionConfig) -> Selection:
    """py-bottom-up-attention style: best class per proposal and its box; class-agnostic NMS at rising
    IoU thresholds until min_boxes survive; the top max_boxes by score."""
    fg = probs[:, :-1]
    scores, classes = fg.max(dim=1)
    boxes = pred_boxes[torch.arange(fg.shape[0], device=fg.device), classes]
    keep = torch.zeros(0, dtype=torch.long, device=fg.device)
    for thresh in cfg.maxnms_thresholds:
        keep = nms(boxes, scores, thresh)
        if keep.numel() >= cfg.min_boxes:
            break
    keep = keep[: cfg.max_boxes]
    return Selection(keep, boxes[keep], classes[keep], scores[keep])


def select_threshold(probs: torch.Tensor, pred_boxes: torch.Tensor, cfg: SelectionConfig) -> Selection:
    """detectron2 fast_rcnn_inference: (proposal, class) pairs above score_thresh, per-class NMS, top
    max_boxes. When fewer than min_boxes pass, the best pairs below the threshold that survive the
    same NMS fill up to min_boxes (lower pairs never suppress higher ones, so the passing set is kept)."""
    fg = probs[:, :-1]
    keep_idx, keep = _per_class_nms(fg, pred_boxes, fg > cfg.score_thresh, cfg.nms_thresh)
    if keep.numel() >= cfg.min_boxes:
        keep = keep[: cfg.max_boxes]
    else:
        keep_idx, keep = _per_class_nms(fg, pred_boxes, torch.ones_like(fg, dtype=torch.bool), cfg.nms_thresh)
        keep = keep[: cfg.min_boxes]
    rows, cols = keep_idx[keep, 0], keep_idx[keep, 1]
    return Selection(rows, pred_boxes[rows, cols], cols, fg[rows, cols])


def _per_class_nms(
    fg: torch.Tensor, pred_boxes: torch.Tensor, mask: torch.Tensor, nms_thresh: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs (K, 2) of (proposal, class) under `mask`, indices of the survivors by decreasing score)."""
    pairs = torch.nonzero(mask)
    rows, cols = pairs[:, 0], pairs[:, 1]
    keep = batched_nms(pred_boxes[rows, cols], fg[rows, cols], cols, nms_thresh)
    return pairs, keep


def _caffe(proposals, probs, pred_boxes, cfg):
    return select_caffe(proposals, probs, cfg)


def _maxnms(proposals, probs, pred_boxes, cfg):
    return select_maxnms(probs, pred_boxes, cfg)


def _threshold(proposals, probs, pred_boxes, cfg):
    return select_threshold(probs, pred_boxes, cfg)


@dataclass(frozen=True)
class Rule:
    """A selection rule: fn(proposals, probs, regressed boxes or None, cfg); `needs_boxes` says whether it
    reads the class-specific regressed boxes (decoding them costs R x C x 4 floats)."""

    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, SelectionConfig], Selection]
    needs_boxes: bool


RULES: dict[str, Rule] = {
    "caffe": Rule(_caffe, needs_boxes=False),
    "maxnms": Rule(_maxnms, needs_boxes=True),
    "threshold": Rule(_threshold, needs_boxes=True),
}


def select(
    proposals: torch.Tensor, probs: torch.Tensor, pred_boxes: torch.Tensor | None, cfg: SelectionConfig
) -> Selection:
    """The regions `cfg.rule` keeps from one image's scored proposals."""
    rule = RULES[cfg.rule]
    if rule.needs_boxes and pred_boxes is None:
        raise ValueError(f"selection rule {cfg.rule!r} needs the regressed boxes")
    return rule.fn(proposals, probs, pred_boxes, cfg)
