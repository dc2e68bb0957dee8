"""Detector scores: COCO box AP through pycocotools, and attribute accuracy on ground-truth boxes."""

from __future__ import annotations

import contextlib
import io
import math

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

# COCOeval.stats order for iouType="bbox" (the first six entries)
METRIC_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl")


def box_ap(coco_gt: dict, detections: list[dict]) -> dict[str, float]:
    """AP@[.5:.95], AP50, AP75 and AP small/medium/large in [0, 1] from COCOeval(iouType="bbox").

    `detections` are `{"image_id", "category_id", "bbox": [x, y, w, h], "score"}` with the category ids
    of `coco_gt`. No detections scores 0; an area range without any ground-truth box is NaN
    (pycocotools' -1: the metric is undefined there, not zero).
    """
    image_ids = {img["id"] for img in coco_gt["images"]}
    category_ids = {cat["id"] for cat in coco_gt["categories"]}
    results = []
    for n, det in enumerate(detections):
        if det["image_id"] not in image_ids:
            raise ValueError(
                f"detection {n} is on image_id {det['image_id']}, which is not in the ground truth"
            )
        if det["category_id"] not in category_ids:
            raise ValueError(
                f"detection {n} has category_id {det['category_id']}, which is not in the ground truth "
                "(ids are class index + 1)"
            )
        x, y, w, h = (float(v) for v in det["bbox"])
        results.append(
            {
                "id": n + 1,
                "image_id": det["image_id"],
                "category_id": det["category_id"],
                "bbox": [x, y, w, h],
                "score": float(det["score"]),
                "area": w * h,
                "iscrowd": 0,
            }
        )
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = {
            "images": list(coco_gt["images"]),
            "annotations": [dict(a) for a in coco_gt["annotations"]],  # COCOeval adds keys to them
            "categories": list(coco_gt["categories"]),
        }
        gt.createIndex()
        dt = COCO()
        # built here rather than by loadRes, which cannot take an empty list and edits its input
        dt.dataset = {**gt.dataset, "annotations": results}
        dt.createIndex()
        evaluator = COCOeval(gt, dt, iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return {
        name: float(value) if value >= 0 else math.nan
        for name, value in zip(METRIC_NAMES, evaluator.stats[: len(METRIC_NAMES)], strict=True)
    }


def attribute_accuracy(predicted: np.ndarray, gold: list[np.ndarray]) -> float:
    """Share of ground-truth boxes whose predicted attribute (one index per box) is among its gold
    attributes (-1 entries are padding); boxes without a gold attribute are left out (NaN if all are)."""
    predicted = np.asarray(predicted).reshape(-1)
    if len(predicted) != len(gold):
        raise ValueError(f"{len(predicted)} predicted attributes for {len(gold)} ground-truth boxes")
    correct = counted = 0
    for guess, attrs in zip(predicted.tolist(), gold, strict=True):
        attrs = np.asarray(attrs).reshape(-1)
        attrs = attrs[attrs >= 0]
        if attrs.size == 0:
            continue
        counted += 1
        correct += int(guess in attrs.tolist())
    return correct / counted if counted else math.nan


def format_table(metrics: dict[str, float]) -> str:
    """One row per metric, ×100 as papers report them; undefined (NaN) values show as '-'."""
    width = max([6, *(len(name) for name in metrics)])
    rows = [f"{'metric':<{width}}  {'value':>6}"]
    for name, value in metrics.items():
        shown = "-" if math.isnan(value) else f"{100 * value:6.2f}"
        rows.append(f"{name:<{width}}  {shown:>6}")
    return "\n".join(rows)
