"""Cheap value checks on a decoded record (finite, in range, consistent shapes) before it is trained on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from storage.errors import StoreError
from storage.records import UNKNOWN_LABEL, RegionFeatures

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
        config = (meta.get("provenance") or {}).get("config")
        config = config if isinstance(config, dict) else {}  # provenance is free-form
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
    where = _first_nonfinite(rec.features)
    if where is not None:
        return f"features{where} is {rec.features[where]} (not finite)"
    # a handful of numpy calls when all is well (~60 µs a 36 x 2048 record); the reason only on failure
    return _box_problem(rec.boxes, h, w, limits.box_slack) or _label_problem(rec, limits)


_EXPONENT_BITS = {2: 0x7C00, 4: 0x7F800000, 8: 0x7FF0000000000000}  # all set: inf or NaN


def _first_nonfinite(arr: np.ndarray) -> tuple | None:
    # the exponent bits on the integer view: 30 µs over 36 x 2048 float16, where np.isfinite takes 480
    mask = _EXPONENT_BITS[arr.dtype.itemsize]
    bits = arr.view(arr.dtype.str.replace("f", "u")) & mask
    if bits.size == 0 or bits.max() != mask:
        return None
    return tuple(int(i) for i in np.argwhere(bits == mask)[0])


# box (x1, y1, x2, y2) @ _MARGINS + (sx, sy, w + sx, h + sy, 0, 0): its margins to the image's edges
# (slack included) and its width and height; a sound box has them all >= 0 (NaN fails, as does inf)
_MARGINS = np.array(
    [[1, 0, 0, 0, -1, 0], [0, 1, 0, 0, 0, -1], [0, 0, -1, 0, 1, 0], [0, 0, 0, -1, 0, 1]], np.float32
)


def _box_problem(boxes: np.ndarray, h: int, w: int, slack: float) -> str | None:
    sx, sy = slack * w + 1.0, slack * h + 1.0
    margins = boxes @ _MARGINS + np.array([sx, sy, w + sx, h + sy, 0, 0], np.float32)
    if not boxes.size or margins.min() >= 0:
        return None
    where = _first_nonfinite(boxes)
    if where is not None:
        return f"boxes{where} is {boxes[where]} (not finite)"
    i = int(np.argmin(margins.min(1)))
    box = ", ".join(f"{v:g}" for v in boxes[i])
    return f"box {i} ({box}) lies outside the {w}x{h} image or is inverted"


def _label_problem(rec: RegionFeatures, limits: RecordLimits) -> str | None:
    for ids, conf, count in (
        ("objects_id", "objects_conf", limits.num_objects),
        ("attrs_id", "attrs_conf", limits.num_attributes),
    ):
        labels = getattr(rec, ids)
        # UNKNOWN_LABEL (-1) marks regions imported without detector labels
        if labels.size and (labels.min() < UNKNOWN_LABEL or labels.max() >= count):
            i = int(np.argmax((labels < UNKNOWN_LABEL) | (labels >= count)))
            return f"{ids}[{i}] is {int(labels[i])}, outside 0..{count - 1}"
        scores = getattr(rec, conf)
        # min and max propagate NaN, which fails both comparisons
        if scores.size and not (scores.min() >= -limits.conf_slack and scores.max() <= 1 + limits.conf_slack):
            i = int(np.argmin(np.abs(scores - 0.5) <= 0.5 + limits.conf_slack))
            return f"{conf}[{i}] is {float(scores[i]):g}, outside 0..1"
    return _class_probs_problem(rec.class_probs, rec.num_boxes, limits.conf_slack)


def _class_probs_problem(probs: np.ndarray | None, n: int, slack: float) -> str | None:
    if probs is None:
        return None
    if probs.ndim != 2 or probs.shape[0] != n:
        return f"class_probs have shape {probs.shape} for {n} boxes"
    fine = np.abs(probs.astype(np.float32) - 0.5) <= 0.5 + slack  # False for NaN
    if fine.all():
        return None
    where = tuple(int(i) for i in np.argwhere(~fine)[0])
    return f"class_probs{where} is {float(probs[where]):g}, not a probability"


def bad_record(rec: RegionFeatures, store: object, reason: str) -> BadRecordError:
    """The error for a record that failed `problem`, naming it and its store."""
    return bad_record_named(rec.img_id, store, reason)


def bad_record_named(img_id: str, store: object, reason: str) -> BadRecordError:
    """The error for record `img_id` of `store`, found to fail `problem` for `reason`."""
    return BadRecordError(
        f"record {img_id!r} of store {store} is unusable: {reason}; skip such records with "
        "--skip-bad-records, or re-extract the image"
    )
