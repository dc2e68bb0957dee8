"""`RegionBatch`: several images' regions copied out of one read transaction into padded arrays."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from storage.records import CLASS_PROBS_DTYPE, RegionFeatures

# (shape, dtype) -> an array whose contents do not matter (every slot is written); lets a caller place the
# bulky arrays (features, class probabilities) in memory it chooses (buffers a DataLoader worker shares
# with the training process and reuses, for one)
Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]


@dataclass
class RegionBatch:
    """B images' regions zero-padded to N slots, as stored: features keep the store's dtype (float16 in
    most stores), boxes are in original pixels. Row k holds `img_ids[k]`; slots >= `num_boxes[k]` are 0."""

    img_ids: list[str]
    img_h: np.ndarray  # (B,) int64
    img_w: np.ndarray  # (B,) int64
    num_boxes: np.ndarray  # (B,) int64
    boxes: np.ndarray  # (B, N, 4) float32
    features: np.ndarray  # (B, N, D) the store's dtype
    objects_id: np.ndarray  # (B, N) int64
    objects_conf: np.ndarray  # (B, N) float32
    attrs_id: np.ndarray  # (B, N) int64
    attrs_conf: np.ndarray  # (B, N) float32
    class_probs: np.ndarray | None  # (B, N, C) float16 when every record has them, else None

    @property
    def valid(self) -> np.ndarray:
        """(B, N) True where a slot holds a real region."""
        return np.arange(self.boxes.shape[1])[None, :] < self.num_boxes[:, None]


_PER_REGION = ("features", "boxes", "objects_id", "objects_conf", "attrs_id", "attrs_conf")


def fill_batch(
    records: Sequence[RegionFeatures],
    width: int | None,
    feature_dim: int,
    dtype: np.dtype,
    alloc: Allocator = np.empty,
) -> RegionBatch:
    """Copy `records` (views into a read transaction's map) into padded arrays: features and class
    probabilities in arrays made by `alloc` (padding slots zeroed here), the small ones in new arrays.

    `width` = slots per image (None: the most boxes of these records); a record with more raises."""
    b = len(records)
    counts = np.array([r.num_boxes for r in records], dtype=np.int64)
    n = int(counts.max(initial=0)) if width is None else width
    if counts.size and counts.max() > n:
        k = int(counts.argmax())
        raise ValueError(
            f"record {records[k].img_id!r} holds {counts[k]} regions, more than the {n} slots to pad to"
        )
    classes = [r.class_probs.shape[1] if r.class_probs is not None else 0 for r in records]
    with_probs = b > 0 and all(classes) and len(set(classes)) == 1
    out = RegionBatch(
        img_ids=[r.img_id for r in records],
        img_h=np.array([r.img_h for r in records], dtype=np.int64),
        img_w=np.array([r.img_w for r in records], dtype=np.int64),
        num_boxes=counts,
        boxes=np.zeros((b, n, 4), np.float32),
        features=alloc((b, n, feature_dim), np.dtype(dtype)),
        objects_id=np.zeros((b, n), np.int64),
        objects_conf=np.zeros((b, n), np.float32),
        attrs_id=np.zeros((b, n), np.int64),
        attrs_conf=np.zeros((b, n), np.float32),
        class_probs=alloc((b, n, classes[0]), CLASS_PROBS_DTYPE) if with_probs else None,
    )
    for rec in records:
        if rec.features.shape[1] != feature_dim:
            raise ValueError(
                f"record {rec.img_id!r} holds {rec.features.shape[1]}-d features, the batch {feature_dim}-d"
            )
    if b and bool((counts == n).all()):
        # every record fills every slot (the usual fixed-count store): one C loop per array
        for name in _PER_REGION:
            np.stack([getattr(rec, name) for rec in records], out=getattr(out, name))
        if out.class_probs is not None:
            np.stack([rec.class_probs for rec in records], out=out.class_probs)
        return out
    for k, rec in enumerate(records):
        m = int(counts[k])
        for name in _PER_REGION:
            getattr(out, name)[k, :m] = getattr(rec, name)
        out.features[k, m:] = 0
        if out.class_probs is not None:
            out.class_probs[k, :m] = rec.class_probs
            out.class_probs[k, m:] = 0
    return out


def concat_batches(batches: Sequence[RegionBatch], width: int | None = None) -> RegionBatch:
    """Rows of several batches as one, padded to `width` slots (None: the widest of them)."""
    n = max(b.boxes.shape[1] for b in batches) if width is None else width

    def cat(name: str) -> np.ndarray:
        parts = [getattr(b, name) for b in batches]
        pads = [[(0, 0), (0, n - p.shape[1])] + [(0, 0)] * (p.ndim - 2) for p in parts]
        return np.concatenate([np.pad(p, pad) for p, pad in zip(parts, pads, strict=True)])

    probs = [b.class_probs for b in batches]
    same = all(p is not None for p in probs) and len({p.shape[2] for p in probs}) == 1
    return RegionBatch(
        img_ids=[i for b in batches for i in b.img_ids],
        img_h=np.concatenate([b.img_h for b in batches]),
        img_w=np.concatenate([b.img_w for b in batches]),
        num_boxes=np.concatenate([b.num_boxes for b in batches]),
        boxes=cat("boxes"),
        features=cat("features"),
        objects_id=cat("objects_id"),
        objects_conf=cat("objects_conf"),
        attrs_id=cat("attrs_id"),
        attrs_conf=cat("attrs_conf"),
        class_probs=cat("class_probs") if same else None,
    )
