"""Stored regions to model inputs, the one path: normalised boxes, padded sets + masks.

Batches read with `FeatureReader.read_batch` keep the store's float16 features until they are on the
device: `float_inputs` widens them there (half the bytes through the loader, the pinned copy and PCIe)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipelines.data.shared_memory import as_tensor, batch_allocator
from storage import FeatureReader, RegionFeatures
from storage.batch import RegionBatch


def normalized_boxes(rec: RegionFeatures) -> np.ndarray:
    """Boxes as (x1/W, y1/H, x2/W, y2/H) float32, clipped to [0, 1] as LXMERT's loaders give them."""
    scale = np.array([rec.img_w, rec.img_h, rec.img_w, rec.img_h], dtype=np.float32)
    return np.clip(rec.boxes.astype(np.float32) / scale, 0.0, 1.0)


def region_arrays(rec: RegionFeatures) -> tuple[np.ndarray, np.ndarray]:
    """(features float32 (N, D), normalised boxes (N, 4)) of one image's regions."""
    return np.asarray(rec.features, dtype=np.float32), normalized_boxes(rec)


def normalized_batch_boxes(batch: RegionBatch) -> np.ndarray:
    """(B, N, 4) boxes of a `RegionBatch` as `normalized_boxes` gives them; padding slots stay 0."""
    scale = np.stack([batch.img_w, batch.img_h, batch.img_w, batch.img_h], axis=1).astype(np.float32)
    return np.clip(batch.boxes / scale[:, None, :], 0.0, 1.0)


@dataclass
class PaddedRegions:
    """Region sets zero-padded to one width: feats (B, N, D), boxes (B, N, 4), valid (B, N) True = real."""

    feats: np.ndarray
    boxes: np.ndarray
    valid: np.ndarray

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """`visual_feats`, `visual_pos` and `visual_attention_mask` (1 = real region) as tensors."""
        return {
            "visual_feats": as_tensor(self.feats),
            "visual_pos": torch.from_numpy(self.boxes),
            "visual_attention_mask": torch.from_numpy(self.valid.astype(np.int64)),
        }


def pad_regions(
    feats: Sequence[np.ndarray], boxes: Sequence[np.ndarray], width: int | None = None
) -> PaddedRegions:
    """Zero-pad region sets to `width` slots (None = the largest set); `valid` marks the real regions.
    Features float32 (per-example records, e.g. a single question); batches of stored regions take
    `read_regions` instead."""
    num = max(f.shape[0] for f in feats) if width is None else width
    dim = feats[0].shape[1]
    out_f = np.zeros((len(feats), num, dim), dtype=np.float32)
    out_b = np.zeros((len(feats), num, 4), dtype=np.float32)
    valid = np.zeros((len(feats), num), dtype=bool)
    for i, (f, b) in enumerate(zip(feats, boxes, strict=True)):
        n = f.shape[0]
        if n > num:
            raise ValueError(f"a region set holds {n} regions, more than the {num} slots to pad to")
        out_f[i, :n] = f
        out_b[i, :n] = b
        valid[i, :n] = True
    return PaddedRegions(out_f, out_b, valid)


def read_regions(features: FeatureReader, img_ids: list[str], width: int | None = None) -> PaddedRegions:
    """The images' regions read in one transaction into padded arrays, features in the store's dtype."""
    batch = features.read_batch(img_ids, width, batch_allocator())
    return PaddedRegions(batch.features, normalized_batch_boxes(batch), batch.valid)


def float_inputs(inputs: dict) -> dict:
    """`inputs` with float16 tensors (regions as stored) widened to float32 where they are: call it on
    the device, after the transfer."""
    return {
        k: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float16 else v
        for k, v in inputs.items()
    }
