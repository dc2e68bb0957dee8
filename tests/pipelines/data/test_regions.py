"""Stored regions to model inputs: boxes normalised by the image size, sets padded with a mask."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.data.regions import normalized_boxes, pad_regions, region_arrays
from storage import RegionFeatures


def _record(n: int, w: int = 200, h: int = 100) -> RegionFeatures:
    rng = np.random.default_rng(n)
    boxes = np.array([[10, 20, 110, 60], [0, 0, 250, 120]] * n, np.float32)[:n]
    ones = np.ones(n, np.float32)
    zeros = np.zeros(n, np.int64)
    feats = rng.random((n, 3), dtype=np.float32).astype(np.float16)
    return RegionFeatures("x", h, w, boxes, feats, zeros, ones, zeros, ones)


def test_boxes_are_divided_by_width_and_height_and_clipped():
    boxes = normalized_boxes(_record(2))
    expected = [[10 / 200, 20 / 100, 110 / 200, 60 / 100], [0, 0, 1, 1]]  # the second box leaves the image
    np.testing.assert_allclose(boxes, expected, rtol=1e-6)
    assert boxes.dtype == np.float32
    feats, _ = region_arrays(_record(2))
    assert feats.dtype == np.float32  # float16 stores come out as float32


def test_padding_to_the_largest_set_or_a_fixed_width():
    sets = [region_arrays(_record(n)) for n in (1, 3)]
    padded = pad_regions([f for f, _ in sets], [b for _, b in sets])
    assert padded.feats.shape == (2, 3, 3) and padded.boxes.shape == (2, 3, 4)
    assert padded.valid.tolist() == [[True, False, False], [True, True, True]]
    np.testing.assert_array_equal(padded.feats[0, 0], sets[0][0][0])
    assert not padded.feats[0, 1:].any() and not padded.boxes[0, 1:].any()
    wide = pad_regions([f for f, _ in sets], [b for _, b in sets], width=5)
    assert wide.valid.sum(1).tolist() == [1, 3] and wide.feats.shape[1] == 5
    inputs = wide.model_inputs()
    assert set(inputs) == {"visual_feats", "visual_pos", "visual_attention_mask"}
    assert inputs["visual_attention_mask"].tolist()[0] == [1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="more than the 2 slots"):
        pad_regions([f for f, _ in sets], [b for _, b in sets], width=2)
