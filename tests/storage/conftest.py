"""Deterministic region records for the storage tests."""

from __future__ import annotations

import numpy as np
import pytest

from storage import RegionFeatures


def record(
    index: int, num_boxes: int = 36, feature_dim: int = 64, img_id: str | None = None
) -> RegionFeatures:
    """Record `index` is the same in every process; features are exact in float16."""
    rng = np.random.default_rng(index)
    h, w = int(rng.integers(100, 1000)), int(rng.integers(100, 1000))
    x1 = rng.uniform(0, w / 2, num_boxes)
    y1 = rng.uniform(0, h / 2, num_boxes)
    boxes = np.stack(
        [x1, y1, x1 + rng.uniform(1, w / 2, num_boxes), y1 + rng.uniform(1, h / 2, num_boxes)], 1
    )
    return RegionFeatures(
        img_id=img_id or f"img_{index:06d}",
        img_h=h,
        img_w=w,
        boxes=boxes.astype(np.float32),
        features=rng.uniform(0, 8, (num_boxes, feature_dim)).astype(np.float16).astype(np.float32),
        objects_id=rng.integers(0, 1600, num_boxes),
        objects_conf=rng.random(num_boxes, dtype=np.float32),
        attrs_id=rng.integers(0, 400, num_boxes),
        attrs_conf=rng.random(num_boxes, dtype=np.float32),
    )


def assert_same(a: RegionFeatures, b: RegionFeatures, features_dtype=np.float32) -> None:
    """Every field equal; features compared after casting both to `features_dtype`."""
    assert (a.img_id, a.img_h, a.img_w, a.num_boxes) == (b.img_id, b.img_h, b.img_w, b.num_boxes)
    for name in ("boxes", "objects_conf", "attrs_conf"):
        got, want = getattr(a, name), getattr(b, name)
        assert got.dtype == np.float32 and want.shape == got.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    for name in ("objects_id", "attrs_id"):
        np.testing.assert_array_equal(getattr(a, name).astype(np.int64), getattr(b, name), err_msg=name)
    np.testing.assert_array_equal(a.features.astype(features_dtype), b.features.astype(features_dtype))


@pytest.fixture
def make_record():
    return record


@pytest.fixture
def same():
    return assert_same
