"""Choosing the regions to keep from the scored proposals: the caffe, maxnms and threshold rules.

All rules take one image's proposals (R, 4), class probabilities (R, C+1) with background last and,
for maxnms/threshold, the class-specific regressed boxes (R, C, 4), all in network-input pixels.
NMS is torchvision's (detectron2's IoU, no "+1"). Fewer than `min_boxes` regions are returned as they
are when the image does not have more; nothing is padded. `select_caffe_batched` gives the caffe rule's
regions of a batch of images on fixed shapes, for accelerators (no host sync per image).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.nn.utils.rnn import pad_sequence
from torchvision.ops import batched_nms, nms

CAFFE_FLOORS = (0.05, 0.01, 0.0)
BATCHED_NMS_ELEMENTS = 1 << 24  # images x classes x proposals per greedy pass of the batched caffe rule


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


def nms_suppression(boxes: torch.Tensor, nms_thresh: float) -> torch.Tensor:
    """(B, R, R) bools: box i suppresses box j, i.e. IoU(i, j) > `nms_thresh`, with torchvision's nms
    arithmetic (float64 here; a CUDA kernel compares with the threshold rounded to float32)."""
    x1, y1, x2, y2 = (v[..., None] for v in boxes.double().unbind(-1))  # (B, R, 1) each
    area = (x2 - x1) * (y2 - y1)
    w = (torch.minimum(x2, x2.mT) - torch.maximum(x1, x1.mT)).clamp(min=0)
    h = (torch.minimum(y2, y2.mT) - torch.maximum(y1, y1.mT)).clamp(min=0)
    inter = w * h
    iou = inter / (area + area.mT - inter)
    if boxes.device.type == "cuda":
        nms_thresh = float(torch.tensor(nms_thresh, dtype=torch.float32))
    return iou > nms_thresh


def per_class_max_conf_batched(
    boxes: torch.Tensor, fg: torch.Tensor, valid: torch.Tensor, nms_thresh: float
) -> torch.Tensor:
    """`per_class_max_conf` (floor 0) of a batch: boxes (B, R, 4), fg (B, R, C), valid (B, R) False on the
    rows past an image's proposals -> (B, R), 0 on those rows.

    Fixed shapes, no host sync: the proposals' IoU is shared by all classes, and greedy NMS runs for every
    (image, class) at once in R steps of four ops, each class's rows in decreasing score, ties lower
    proposal first (as a stable sort)."""
    b, r, c = fg.shape
    suppresses = nms_suppression(boxes, nms_thresh)
    # row R suppresses nothing: a suppressed box's step ORs it in, so a step needs no branch
    suppresses = torch.cat([suppresses, suppresses.new_zeros(b, 1, r)], 1)
    max_conf = fg.new_zeros(b, r)
    step = max(1, BATCHED_NMS_ELEMENTS // max(b * r, 1))
    for start in range(0, c, step):
        scores = fg[:, :, start : start + step].transpose(1, 2).masked_fill(~valid[:, None, :], -1.0)
        order = scores.argsort(dim=2, descending=True, stable=True)  # (B, c, R): rows by class score
        suppressed = (~valid)[:, None, :].repeat(1, order.shape[1], 1)  # padding rows start suppressed
        rows = torch.empty_like(suppressed)  # one buffer: a fresh one per step page-faults on CPU
        dropped = []  # by rank
        for k in range(r):
            gone = suppressed.gather(2, order[:, :, k : k + 1])
            dropped.append(gone)
            row = torch.where(gone, r, order[:, :, k : k + 1])
            suppressed |= torch.gather(suppresses, 1, row.expand_as(rows), out=rows)
        kept = torch.zeros_like(order, dtype=torch.bool)
        kept.scatter_(2, order, ~torch.cat(dropped, 2))  # by proposal
        max_conf = torch.maximum(max_conf, torch.where(kept, scores, 0.0).amax(dim=1))
    return max_conf


def select_caffe_padded(
    proposals: torch.Tensor, probs: torch.Tensor, valid: torch.Tensor, cfg: SelectionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_caffe` of a padded batch (proposals (B, R, 4), probs (B, R, C+1), valid (B, R)) on fixed
    shapes without a host sync: (rows (B, K) into the proposals, K = min(max_boxes, R), and each image's
    kept count (B,)); an image's regions are rows[i, :count[i]], the same in the same order."""
    count = valid.sum(1)
    # select_caffe's floors only spare it work: where its loop stops, the rows it ranks have their exact
    # max_conf and all the others rank below them, so ranking the exact values keeps the same rows
    max_conf = per_class_max_conf_batched(proposals, probs[..., :-1], valid, cfg.nms_thresh)
    max_conf = torch.where(valid, max_conf, -1.0)  # padding sorts last and never passes
    passing = max_conf >= cfg.conf_thresh
    passed = passing.sum(1)
    in_order = (~passing).to(torch.uint8).argsort(dim=1, stable=True)  # the passing rows first, in order
    by_conf = max_conf.argsort(dim=1, descending=True, stable=True)
    few, many = passed < cfg.min_boxes, passed > cfg.max_boxes
    kept = torch.where(few, count.clamp(max=cfg.min_boxes), torch.where(many, cfg.max_boxes, passed))
    rows = torch.where((few | many)[:, None], by_conf, in_order)
    return rows[:, : cfg.max_boxes], kept


def select_caffe_batched(
    proposals: list[torch.Tensor], probs: list[torch.Tensor], cfg: SelectionConfig
) -> list[Selection]:
    """`select_caffe` of each image, computed for all of them together on fixed shapes
    (`select_caffe_padded`): the same regions in the same order, one host sync (the kept counts)."""
    sizes = [p.shape[0] for p in proposals]
    if not sizes or max(sizes) == 0:
        return [select_caffe(p, q, cfg) for p, q in zip(proposals, probs, strict=True)]
    # the validity mask is built on the device: a tensor of the sizes copied up would be a host sync
    valid = pad_sequence([q.new_ones(q.shape[0], dtype=torch.bool) for q in probs], batch_first=True)
    boxes, scores = (pad_sequence(list(t), batch_first=True) for t in (proposals, probs))
    rows, kept = select_caffe_padded(boxes, scores, valid, cfg)
    selections = []
    for i, n in enumerate(kept.tolist()):  # the one host sync
        keep = rows[i, :n]
        scores, classes = probs[i][:, :-1][keep].max(dim=1)
        selections.append(Selection(keep, proposals[i][keep], classes, scores))
    return selections


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
