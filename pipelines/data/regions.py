"""Stored regions to model inputs, the one path: normalised boxes, padded sets + masks.

Batches read with `FeatureReader.read_batch` keep the store's float16 features until they are on the
device: `float_inputs` widens them there (half the bytes through the loader, the pinned copy and PCIe)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipelines.data.shared_memory import batch_allocator
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


IMAGE_SIZE = "image_size"  # (B, 2) float32 (width, height) in pixels, for models that read it


def image_sizes(img_w, img_h) -> np.ndarray:
    """(B, 2) float32 (width, height) of images whose widths and heights are `img_w`, `img_h`."""
    return np.stack([np.asarray(img_w), np.asarray(img_h)], axis=-1).astype(np.float32).reshape(-1, 2)


@dataclass
class PaddedRegions:
    """Region sets zero-padded to one width: feats (B, N, D), boxes (B, N, 4), valid (B, N) True = real;
    `sizes` (B, 2) the images' (width, height) in pixels where known (VL-BERT rebuilds its release's
    pixel arithmetic from them: boxes are already divided by the size here)."""

    feats: np.ndarray
    boxes: np.ndarray
    valid: np.ndarray
    sizes: np.ndarray | None = None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """`visual_feats`, `visual_pos`, `visual_attention_mask` (1 = real region) and, where the sizes
        are known, `image_size`, as tensors (`inputs_for` drops it for models that do not read it)."""
        out = {
            "visual_feats": torch.from_numpy(self.feats),
            "visual_pos": torch.from_numpy(self.boxes),
            "visual_attention_mask": torch.from_numpy(self.valid.astype(np.int64)),
        }
        if self.sizes is not None:
            out[IMAGE_SIZE] = torch.from_numpy(self.sizes)
        return out

    @staticmethod
    def concat(parts: Sequence[PaddedRegions]) -> PaddedRegions:
        """Several padded sets as one, padded to the widest; sizes kept when every part has them."""
        slots = max(p.valid.shape[1] for p in parts)

        def pad(a: np.ndarray) -> np.ndarray:
            return np.pad(a, [(0, 0), (0, slots - a.shape[1])] + [(0, 0)] * (a.ndim - 2))

        sizes = [p.sizes for p in parts]
        return PaddedRegions(
            np.concatenate([pad(p.feats) for p in parts]),
            np.concatenate([pad(p.boxes) for p in parts]),
            np.concatenate([pad(p.valid) for p in parts]),
            np.concatenate(sizes) if all(s is not None for s in sizes) else None,
        )


def inputs_for(model: torch.nn.Module, inputs: dict) -> dict:
    """`inputs` less `image_size` unless `model` reads it (its class sets `takes_image_size`); a
    DistributedDataParallel wrapper is looked through."""
    module = getattr(model, "module", model)
    if getattr(module, "takes_image_size", False) or IMAGE_SIZE not in inputs:
        return inputs
    return {k: v for k, v in inputs.items() if k != IMAGE_SIZE}


def pad_regions(
    feats: Sequence[np.ndarray],
    boxes: Sequence[np.ndarray],
    width: int | None = None,
    sizes: np.ndarray | None = None,
) -> PaddedRegions:
    """Zero-pad region sets to `width` slots (None = the largest set); `valid` marks the real regions;
    `sizes` (B, 2) the images' (width, height), see `image_sizes`. Features float32 (per-example
    records, e.g. a single question); batches of stored regions take
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
    return PaddedRegions(out_f, out_b, valid, sizes)


def read_regions(features: FeatureReader, img_ids: list[str], width: int | None = None) -> PaddedRegions:
    """The images' regions read in one transaction into padded arrays, features in the store's dtype."""
    batch = features.read_batch(img_ids, width, batch_allocator())
    sizes = image_sizes(batch.img_w, batch.img_h)
    return PaddedRegions(batch.features, normalized_batch_boxes(batch), batch.valid, sizes)


def float_inputs(inputs: dict) -> dict:
    """`inputs` with float16 tensors (regions as stored) widened to float32 where they are: call it on
    the device, after the transfer."""
    return {
        k: v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float16 else v
        for k, v in inputs.items()
    }
