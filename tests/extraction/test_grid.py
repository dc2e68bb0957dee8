"""Grid features: cells against res5 of the whole map pooled here, batch invariance, cells that tile the
image, labels from the box predictor, and a provenance that says grid and rebuilds it."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from extraction import Detector
from extraction.config import SMALL_PRESET
from extraction.grid import GridConfig
from extraction.postprocess import attribute_confidence
from extraction.preprocess import batch_images, resize_image
from extraction.provenance import detector_settings

SPECS = ("14x14", "native/2", "3x5", "14x14@32", "native/1@32")


@pytest.fixture(scope="module")
def detectors() -> dict[str, Detector]:
    """The small preset with random weights, one detector per grid, all sharing one network."""
    torch.set_num_threads(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = Detector.build(SMALL_PRESET, grid="14x14")
    return {
        spec: Detector(
            base.model, base.config, base.selection, base.preset, base._weights, grid=GridConfig.parse(spec)
        )
        for spec in SPECS
    }


def _res5_map(det: Detector, image: np.ndarray) -> tuple[torch.Tensor, tuple[int, int]]:
    """res5 over the whole res4 map of one image, computed here from the network's parts, (D, H, W): the
    RoI head's dilated stage as it is, and for a stride-32 grid that map's even rows and columns."""
    cfg = det.config
    resized = resize_image(image, cfg.min_size, cfg.max_size)
    x = batch_images([resized], cfg.pixel_mean, cfg.pixel_std, torch.device("cpu"))[0]
    with torch.inference_mode():
        res5 = det.model.roi_heads.res5(det.model.backbone(x))[0].float()
    if det.grid.stride == 32:
        res5 = res5[:, ::2, ::2]
    return res5, resized.shape[:2]


def _pool_here(res5: torch.Tensor, grid: GridConfig) -> np.ndarray:
    """Cell means written out bin by bin (adaptive pooling's floor/ceil bins, or K x K windows cut at the
    map's edge), row-major: (cells, D)."""
    fmap = res5.double().numpy()
    _, h, w = fmap.shape
    if grid.pool is None:
        rows = [(math.floor(i * h / grid.rows), math.ceil((i + 1) * h / grid.rows)) for i in range(grid.rows)]
        cols = [(math.floor(j * w / grid.cols), math.ceil((j + 1) * w / grid.cols)) for j in range(grid.cols)]
    else:
        k = grid.pool
        rows = [(i, min(i + k, h)) for i in range(0, h, k)]
        cols = [(j, min(j + k, w)) for j in range(0, w, k)]
    return np.stack([fmap[:, r0:r1, c0:c1].mean(axis=(1, 2)) for r0, r1 in rows for c0, c1 in cols])


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(150, 260), (333, 97)])  # the second's map has an odd width
def test_cells_equal_res5_of_the_whole_map_pooled_here(detectors, make_image, spec, shape):
    det = detectors[spec]
    image = make_image(3, *shape)
    record = det.detect([image], ["a"])[0]
    res5, _ = _res5_map(det, image)
    want = _pool_here(res5, det.grid)
    assert record.features.shape == want.shape
    np.testing.assert_allclose(record.features, want, rtol=1e-5, atol=1e-5)

    # each cell's labels are the box predictor's on the cell feature
    feats = torch.from_numpy(record.features)
    with torch.inference_mode():
        cls_logits, _, attr_logits = det.model.roi_heads.box_predictor(feats)
    probs = torch.softmax(cls_logits, dim=-1)[:, :-1]
    np.testing.assert_array_equal(record.objects_id, probs.argmax(dim=1).numpy())
    np.testing.assert_allclose(record.objects_conf, probs.max(dim=1).values.numpy(), rtol=1e-5)
    np.testing.assert_array_equal(record.attrs_id, attribute_confidence(attr_logits, "caffe")[1].numpy())


@pytest.mark.parametrize("spec", ["14x14", "native/1@32"])
def test_a_cell_does_not_depend_on_its_batch_mates_bit_for_bit(detectors, make_image, spec):
    det = detectors[spec]
    images = [make_image(s, h, w) for s, (h, w) in enumerate([(120, 200), (240, 160), (90, 90)])]
    together = det.detect(images, ["a", "b", "c"])
    for i, image in enumerate(images):
        alone = det.detect([image], [together[i].img_id])[0]
        for name in ("features", "boxes", "objects_id", "objects_conf", "attrs_id", "attrs_conf"):
            np.testing.assert_array_equal(getattr(alone, name), getattr(together[i], name), err_msg=name)
    reversed_ = det.detect(images[::-1], ["c", "b", "a"])
    np.testing.assert_array_equal(reversed_[2].features, together[0].features)


def _assert_tiles(boxes: np.ndarray, h: int, w: int) -> None:
    """Inside the image, no two cells overlap, and together they cover its area."""
    assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all()
    assert (boxes[:, 2] <= w).all() and (boxes[:, 3] <= h).all()
    assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
    b = boxes.astype(np.float64)
    ix = np.clip(np.minimum(b[:, None, 2], b[None, :, 2]) - np.maximum(b[:, None, 0], b[None, :, 0]), 0, None)
    iy = np.clip(np.minimum(b[:, None, 3], b[None, :, 3]) - np.maximum(b[:, None, 1], b[None, :, 1]), 0, None)
    overlap = ix * iy
    np.fill_diagonal(overlap, 0)
    assert overlap.max() < 1e-3
    area = ((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])).sum()
    assert area == pytest.approx(h * w, rel=1e-5)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(150, 260), (333, 97), (64, 64)])
def test_cell_boxes_tile_the_image_in_its_own_pixels(detectors, make_image, spec, shape):
    det = detectors[spec]
    record = det.detect([make_image(1, *shape)], ["x"])[0]
    assert (record.img_h, record.img_w) == shape
    _assert_tiles(record.boxes, *shape)
    res5, _ = _res5_map(det, make_image(1, *shape))
    grid = det.grid
    rows = grid.rows if grid.pool is None else math.ceil(res5.shape[1] / grid.pool)
    cols = grid.cols if grid.pool is None else math.ceil(res5.shape[2] / grid.pool)
    assert record.num_boxes == rows * cols <= grid.max_cells(det.config)
    # row-major: the first row's cells share a top edge and go left to right
    first_row = record.boxes[:cols]
    assert (first_row[:, 1] == 0).all() and (np.diff(first_row[:, 0]) > 0).all()


def test_provenance_says_grid_and_how_and_rebuilds_the_same_extractor(detectors):
    for spec, det in detectors.items():
        prov = det.provenance()
        assert prov["features"] == "grid" and prov["grid"] == spec
        assert "res5 over the whole res4 map" in prov["grid_method"]
        assert prov["max_boxes"] == det.grid.max_cells(det.config)
        assert detector_settings(prov)["grid"] == spec
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        regions = Detector.build(SMALL_PRESET).provenance()
    assert regions["features"] == "regions" and "grid" not in detector_settings(regions)


def test_grid_specs_parse_and_bad_ones_are_one_clear_line():
    assert GridConfig.parse("14x14") == GridConfig(14, 14)
    assert GridConfig.parse(" 7X9 ") == GridConfig(7, 9)
    assert GridConfig.parse("native/2").pool == 2
    assert GridConfig.parse("14x14@32") == GridConfig(14, 14, stride=32)
    assert GridConfig.parse("native/1@32") == GridConfig(pool=1, stride=32)
    assert GridConfig.parse("7x9@16") == GridConfig(7, 9)  # 16 is the default, and its spec omits it
    assert GridConfig.parse("7x9@16").spec == "7x9" and GridConfig(pool=1, stride=32).spec == "native/1@32"
    for bad in ("14", "0x3", "native/0", "native", "14x14x2", "14x14@24", "14x14@", "native/2@8"):
        with pytest.raises(ValueError, match="14x14|at least|stride") as err:
            GridConfig.parse(bad)
        assert "\n" not in str(err.value)


def test_a_stride_32_grid_needs_res5_dilated_by_2_and_says_so():
    """Every other row and column of the stride-16 map is res5 undilated only when the stage is dilated
    by 2; any other stage is refused in one line rather than given different features."""
    from extraction.backbone import make_stage

    stage = make_stage(1, 8, 16, 4, first_stride=1, dilation=1)
    with pytest.raises(ValueError, match="res5_dilation 2.*stride-16 grid") as err:
        GridConfig.parse("14x14@32").res5_map(stage, torch.zeros(1, 8, 6, 6))
    assert "\n" not in str(err.value)
    dilated = make_stage(2, 8, 16, 4, first_stride=1, dilation=2).eval()
    x = torch.randn(1, 8, 7, 10)
    with torch.inference_mode():
        want = dilated(x)[:, :, ::2, ::2]
        got = GridConfig.parse("14x14@32").res5_map(dilated, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
