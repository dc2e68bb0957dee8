"""VL-BERT's whole-image box and box clamping follow the release's pixel arithmetic, recomputed here."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model.vlbert import VlBert, VlBertConfig
from model.vlbert.geometry import box_geometry, release_boxes
from pipelines.data.example_batch import ExampleBatch
from pipelines.data.regions import PaddedRegions, image_sizes, inputs_for, pad_regions


def release_geometry(pixel_boxes: np.ndarray, w: float, h: float, dim: int) -> np.ndarray:
    """The release's loader then geometry, in pixels: the image prepended as [0, 0, w-1, h-1], boxes
    clamped to [0, w-1] x [0, h-1], then (xc, yc, bw, bh) / (w, h) x 100 through sin/cos of
    1000^(i/F) wavelengths, laid out per coordinate as [sin ; cos]."""
    rows = [[0.0, 0.0, w - 1, h - 1]] + [list(b) for b in pixel_boxes]
    out = []
    for x1, y1, x2, y2 in rows:
        x1, x2 = (min(max(v, 0.0), w - 1) for v in (x1, x2))
        y1, y2 = (min(max(v, 0.0), h - 1) for v in (y1, y2))
        pos = [(x1 + x2) / 2 / w * 100, (y1 + y2) / 2 / h * 100, (x2 - x1) / w * 100, (y2 - y1) / h * 100]
        f = dim // 8
        row = []
        for p in pos:
            angles = [p / 1000 ** (i / f) for i in range(f)]
            row += [math.sin(a) for a in angles] + [math.cos(a) for a in angles]
        out.append(row)
    return np.array(out)


def stored_boxes(pixel_boxes: np.ndarray, w: int, h: int) -> np.ndarray:
    """Boxes as the pipelines hand them to models: divided by the image size, clipped to [0, 1]."""
    return np.clip(pixel_boxes / np.array([w, h, w, h], dtype=np.float32), 0, 1).astype(np.float32)


# a box reaching the image's last pixel column and row (x2 = w, y2 = h) and one inside
PIXELS = np.array([[10.0, 20.0, 640.0, 480.0], [3.5, 7.25, 100.0, 200.0]], dtype=np.float32)


def test_geometry_equals_the_release_pixel_arithmetic():
    w, h, dim = 640, 480, 64
    boxes = torch.from_numpy(stored_boxes(PIXELS, w, h))[None]
    whole, clamped = release_boxes(boxes, torch.tensor([[w, h]], dtype=torch.float32))
    ours = box_geometry(torch.cat([whole, clamped], 1), dim)[0].double().numpy()
    np.testing.assert_allclose(ours, release_geometry(PIXELS, w, h, dim), atol=2e-5)
    # the [0, 0, 1, 1] image box (no sizes) is a different input: the test can tell them apart
    whole_unit, _ = release_boxes(boxes, None)
    unit = box_geometry(torch.cat([whole_unit, boxes], 1), dim)[0].double().numpy()
    assert np.abs(unit - release_geometry(PIXELS, w, h, dim)).max() > 1e-3


def test_image_size_shape_is_checked():
    with pytest.raises(ValueError, match="image_size"):
        release_boxes(torch.zeros(2, 3, 4), torch.ones(3, 2))


def test_sizes_travel_from_padded_regions_to_the_model():
    """pad_regions -> ExampleBatch.concat -> model_inputs carries (w, h); VL-BERT's output with them is
    its output with the release's boxes given directly, and differs from the [0, 0, 1, 1] one."""
    torch.manual_seed(0)
    cfg = VlBertConfig.preset("tiny", visual_feat_dim=8)
    model = VlBert(cfg).eval()
    with torch.no_grad():  # the release starts these scales at 0, which would hide the boxes
        for ln in (model.visual_ln_text, model.visual_ln_object):
            ln.weight.fill_(1.0)
    feats = [np.random.default_rng(k).normal(size=(2, 8)).astype(np.float32) for k in range(2)]
    sizes = [(640, 480), (300, 500)]
    parts = [
        ExampleBatch(
            ids=[k],
            images=[f"img{k}"],
            regions=pad_regions(
                [feats[k]], [stored_boxes(PIXELS, *sizes[k])], sizes=image_sizes([sizes[k][0]], [sizes[k][1]])
            ),
        )
        for k in range(2)
    ]
    regions = ExampleBatch.concat(parts).regions
    np.testing.assert_array_equal(regions.sizes, np.array(sizes, dtype=np.float32))
    inputs = regions.model_inputs()
    ids = torch.tensor([[101, 2054, 102], [101, 2003, 102]])
    with torch.no_grad():
        got = model(ids, **inputs_for(model, inputs)).sequence_output
        bare = {k: v for k, v in inputs.items() if k != "image_size"}
        unit = model(ids, **bare).sequence_output
    assert not torch.allclose(got, unit, atol=1e-4)
    # the release's boxes recomputed in pixels and normalised, fed as if they were stored that way
    clamped = []
    for w, h in sizes:
        px = PIXELS.copy()
        px[:, [0, 2]] = px[:, [0, 2]].clip(0, w - 1)
        px[:, [1, 3]] = px[:, [1, 3]].clip(0, h - 1)
        clamped.append(px / np.array([w, h, w, h], dtype=np.float32))
    assert not np.allclose(np.stack(clamped), inputs["visual_pos"].numpy())  # clamping changes them
    whole = torch.tensor([[[0, 0, (w - 1) / w, (h - 1) / h]] for w, h in sizes], dtype=torch.float32)
    direct_boxes = torch.cat([whole, torch.from_numpy(np.stack(clamped))], 1)
    ours_boxes = torch.cat(release_boxes(inputs["visual_pos"], inputs["image_size"]), 1)
    np.testing.assert_allclose(ours_boxes.numpy(), direct_boxes.numpy(), atol=1e-6)


def test_other_families_do_not_receive_image_size():
    from model.lxmert import Lxmert, LxmertConfig

    regions = PaddedRegions(
        np.zeros((1, 2, 4), np.float32),
        np.zeros((1, 2, 4), np.float32),
        np.ones((1, 2), bool),
        np.array([[10.0, 20.0]], np.float32),
    )
    inputs = regions.model_inputs()
    assert "image_size" in inputs
    assert "image_size" not in inputs_for(Lxmert(LxmertConfig.preset("tiny")), inputs)
    assert "image_size" in inputs_for(VlBert(VlBertConfig.preset("tiny")), inputs)
