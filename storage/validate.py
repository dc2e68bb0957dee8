"""Cheap value checks on a decoded record (finite, in range, consistent shapes) before it is trained on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from storage.errors import StoreError
from storage.records import RegionFeatures

VG_OBJECTS = 1600  # Visual Genome classes the VG detector predicts (background excluded)
VG_ATTRIBUTES = 400


class BadRecordError(StoreError, ValueError):
    """A record decodes but holds values no model should see: names the record, the store and the fix."""


@dataclass(frozen=True)
class RecordLimits:
    """What a sound record holds. Boxes may overhang the image by `box_slack` of its side plus one pixel
    (imported features are not always clipped); confidences may exceed [0, 1] by `conf_slack`."""

    feature_dim: int | None = None
    max_boxes: int | None = None
    num_objects: int = VG_OBJECTS
    num_attributes: int = VG_ATTRIBUTES
    box_slack: float = 0.01
    conf_slack: float = 1e-3

    @classmethod
    def from_meta(cls, meta: dict, **overrides) -> RecordLimits:
        """The limits of a store: its shapes, and the detector's class counts when its provenance has them."""
        config = meta.get("provenance", {}).get("config", {})
        found = {
            "feature_dim": meta.get("feature_dim"),
            "max_boxes": meta.get("max_boxes"),
            "num_objects": config.get("num_classes", VG_OBJECTS),
            "num_attributes": config.get("num_attributes", VG_ATTRIBUTES),
        }
        return cls(**{**found, **overrides})


def problem(rec: RegionFeatures, limits: RecordLimits) -> str | None:
    """Why `rec` must not be used, in a few words, or None when it passes every check."""
    h, w = int(rec.img_h), int(rec.img_w)
    if h <= 0 or w <= 0:
        return f"image size {w}x{h} is not positive"
    n = rec.boxes.shape[0] if rec.boxes.ndim == 2 else -1
    if rec.boxes.shape != (n, 4):
        return f"boxes have shape {rec.boxes.shape}, expected (N, 4)"
    for name in ("features", "objects_id", "objects_conf", "attrs_id", "attrs_conf"):
        if getattr(rec, name).shape[:1] != (n,):
            return f"{name} has {getattr(rec, name).shape[:1]} rows but there are {n} boxes"
    if rec.features.ndim != 2:
        return f"features have shape {rec.features.shape}, expected (N, D)"
    if limits.feature_dim is not None and rec.features.shape[1] != limits.feature_dim:
        return f"features are {rec.features.shape[1]}-d, the store's are {limits.feature_dim}-d"
    if limits.max_boxes is not None and n > limits.max_boxes:
        return f"{n} boxes exceed max_boxes={limits.max_boxes}"
    for name in ("features", "boxes", "objects_conf", "attrs_conf"):
        where = _first_nonfinite(getattr(rec, name))
        if where is not None:
            return f"{name}{where} is {getattr(rec, name)[where]} (not finite)"
    return _box_problem(rec.boxes, h, w, limits.box_slack) or _label_problem(rec, limits)


def _first_nonfinite(arr: np.ndarray) -> tuple | None:
    # np.isfinite over 36 x 2048 float16 is ~20 µs; the argwhere only runs on a bad record
    if np.isfinite(arr).all():
        return None
    return tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])


def _box_problem(boxes: np.ndarray, h: int, w: int, slack: float) -> str | None:
    x1, y1, x2, y2 = boxes.T
    sx, sy = slack * w + 1.0, slack * h + 1.0
    bad = (x1 < -sx) | (y1 < -sy) | (x2 > w + sx) | (y2 > h + sy) | (x2 < x1) | (y2 < y1)
    if not bad.any():
        return None
    i = int(np.argmax(bad))
    box = ", ".join(f"{v:g}" for v in boxes[i])
    return f"box {i} ({box}) lies outside the {w}x{h} image or is inverted"


def _label_problem(rec: RegionFeatures, limits: RecordLimits) -> str | None:
    for ids, conf, count in (
        ("objects_id", "objects_conf", limits.num_objects),
        ("attrs_id", "attrs_conf", limits.num_attributes),
    ):
        labels = getattr(rec, ids)
        if labels.size and (labels.min() < 0 or labels.max() >= count):
            i = int(np.argmax((labels < 0) | (labels >= count)))
            return f"{ids}[{i}] is {int(labels[i])}, outside 0..{count - 1}"
        scores = getattr(rec, conf)
        if scores.size and (scores.min() < -limits.conf_slack or scores.max() > 1 + limits.conf_slack):
            i = int(np.argmax((scores < -limits.conf_slack) | (scores > 1 + limits.conf_slack)))
            return f"{conf}[{i}] is {float(scores[i]):g}, outside 0..1"
    return None


def bad_record(rec: RegionFeatures, store: object, reason: str) -> BadRecordError:
    """The error for a record that failed `problem`, naming it and its store."""
    return BadRecordError(
        f"record {rec.img_id!r} of store {store} is unusable: {reason}; skip such records with "
        "--skip-bad-records, or re-extract the image"
    )
