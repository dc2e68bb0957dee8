"""`RegionFeatures`: the detector's output for one image, as stored and read back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ARRAY_FIELDS: dict[str, tuple[np.dtype, int]] = {
    # name: (canonical dtype, number of dimensions); features' dtype is the set's (float16 or float32)
    "boxes": (np.dtype("<f4"), 2),
    "features": (np.dtype("<f4"), 2),
    "objects_id": (np.dtype("<i8"), 1),
    "objects_conf": (np.dtype("<f4"), 1),
    "attrs_id": (np.dtype("<i8"), 1),
    "attrs_conf": (np.dtype("<f4"), 1),
}
# objects_id / attrs_id of a region whose detector labels the source did not carry (its confidence is 0)
UNKNOWN_LABEL = -1
CLASS_PROBS_DTYPE = np.dtype("<f2")  # stored dtype of the optional per-region class distribution


@dataclass
class RegionFeatures:
    """The regions found in one image: N boxes (x1, y1, x2, y2 in original pixels) and their features."""

    img_id: str
    img_h: int
    img_w: int
    boxes: np.ndarray
    features: np.ndarray
    objects_id: np.ndarray
    objects_conf: np.ndarray
    attrs_id: np.ndarray
    attrs_conf: np.ndarray
    # the detector's distribution over its classes per region (N, C), background included (C = 1601 for
    # the VG detector); None when not extracted or read from an older store
    class_probs: np.ndarray | None = None
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_boxes(self) -> int:
        return int(self.boxes.shape[0])

    @property
    def feature_dim(self) -> int:
        return int(self.features.shape[1])

    @property
    def labels_known(self) -> bool:
        """False when the source carried no detector labels (ids are UNKNOWN_LABEL)."""
        return not (self.objects_id.size and (self.objects_id == UNKNOWN_LABEL).all())

    def validate(self, feature_dim: int | None = None, max_boxes: int | None = None) -> None:
        """Raise ValueError naming the record and the field when shapes disagree."""
        where = f"record {self.img_id!r}"
        if not isinstance(self.img_id, str) or not self.img_id:
            raise ValueError(f"{where}: img_id must be a non-empty string")
        if int(self.img_h) <= 0 or int(self.img_w) <= 0:
            raise ValueError(f"{where}: img_h and img_w must be positive, got {self.img_h}x{self.img_w}")
        n = None
        for name, (_, ndim) in ARRAY_FIELDS.items():
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray):
                raise ValueError(f"{where}: {name} must be a numpy array, got {type(arr).__name__}")
            if arr.ndim != ndim:
                raise ValueError(f"{where}: {name} must have {ndim} dimensions, got shape {arr.shape}")
            if n is None:
                n = arr.shape[0]
            elif arr.shape[0] != n:
                raise ValueError(f"{where}: {name} has {arr.shape[0]} rows but boxes has {n}")
        if self.boxes.shape[1] != 4:
            raise ValueError(f"{where}: boxes must be N x 4, got {self.boxes.shape}")
        if feature_dim is not None and self.features.shape[1] != feature_dim:
            raise ValueError(
                f"{where}: features are {self.features.shape[1]}-d but the set holds {feature_dim}-d features"
            )
        if max_boxes is not None and n > max_boxes:
            raise ValueError(f"{where}: {n} boxes exceed the set's max_boxes={max_boxes}")
        for name in ("objects_id", "attrs_id"):
            if getattr(self, name).dtype.kind not in "iu":
                raise ValueError(f"{where}: {name} must hold integers, got {getattr(self, name).dtype}")
        for name in ("boxes", "features", "objects_conf", "attrs_conf"):
            if getattr(self, name).dtype.kind != "f":
                raise ValueError(f"{where}: {name} must hold floats, got {getattr(self, name).dtype}")
        if self.class_probs is not None:
            self._validate_class_probs(where, n)

    def _validate_class_probs(self, where: str, n: int) -> None:
        probs = self.class_probs
        if not isinstance(probs, np.ndarray) or probs.ndim != 2 or probs.dtype.kind != "f":
            raise ValueError(f"{where}: class_probs must be a float array N x classes, or None")
        if probs.shape[0] != n or probs.shape[1] == 0:
            raise ValueError(f"{where}: class_probs has shape {probs.shape} for {n} boxes")
        # probabilities: float16 keeps [0, 1] to 3 decimals, anything else (logits) would not survive
        if probs.size and not (np.isfinite(probs).all() and probs.min() >= 0 and probs.max() <= 1.001):
            raise ValueError(f"{where}: class_probs must be probabilities in [0, 1] (softmax, not logits)")
