"""Detector end to end on random weights: fields, batch invariance, determinism, honesty, provenance."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from extraction import Detector
from storage import RegionFeatures

SIZES = [(70, 50), (50, 90), (64, 64)]


def state_hash(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def images(make_image) -> list[np.ndarray]:
    return [make_image(i, h, w) for i, (h, w) in enumerate(SIZES)]


@pytest.fixture(scope="module")
def batched(small_detector, images) -> list[RegionFeatures]:
    return small_detector.detect(images, ids=["a", "b", "c"])


@pytest.fixture(scope="module")
def singles(small_detector, images) -> list[RegionFeatures]:
    return [small_detector.detect([image], ids=[name])[0] for image, name in zip(images, "abc", strict=True)]


def check_record(rec: RegionFeatures, h: int, w: int, max_boxes: int) -> None:
    rec.validate(feature_dim=2048, max_boxes=max_boxes)
    assert (rec.img_h, rec.img_w) == (h, w)
    assert rec.features.dtype == np.float32 and rec.features.shape == (rec.num_boxes, 2048)
    assert rec.boxes.dtype == np.float32 and rec.objects_conf.dtype == np.float32
    assert rec.attrs_conf.dtype == np.float32
    assert rec.objects_id.dtype == np.int64 and rec.attrs_id.dtype == np.int64
    assert ((rec.objects_id >= 0) & (rec.objects_id < 1600)).all()
    assert ((rec.attrs_id >= 0) & (rec.attrs_id < 400)).all()
    assert ((rec.objects_conf > 0) & (rec.objects_conf <= 1)).all()
    assert ((rec.attrs_conf > 0) & (rec.attrs_conf <= 1)).all()
    assert np.isfinite(rec.features).all()
    b = rec.boxes
    assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all() and (b[:, 2] <= w).all() and (b[:, 3] <= h).all()
    assert (b[:, 2] >= b[:, 0]).all() and (b[:, 3] >= b[:, 1]).all()


def test_output_fields(batched):
    assert [r.img_id for r in batched] == ["a", "b", "c"]
    for rec, (h, w) in zip(batched, SIZES, strict=True):
        check_record(rec, h, w, max_boxes=6)
        assert 2 <= rec.num_boxes <= 6


def test_batch_equals_one_image_at_a_time(batched, singles):
    for alone, rec in zip(singles, batched, strict=True):
        assert alone.num_boxes == rec.num_boxes
        np.testing.assert_array_equal(alone.objects_id, rec.objects_id)
        np.testing.assert_array_equal(alone.attrs_id, rec.attrs_id)
        np.testing.assert_allclose(alone.boxes, rec.boxes, atol=1e-2)
        np.testing.assert_allclose(alone.features, rec.features, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(alone.objects_conf, rec.objects_conf, rtol=1e-4, atol=1e-6)


def test_detection_from_a_path_repeats_exactly(small_detector, images, singles, tmp_path):
    import cv2

    path = tmp_path / "a.png"
    cv2.imwrite(str(path), images[0])
    again = small_detector.detect([path])[0]
    assert again.img_id == "a"
    for name in ("boxes", "features", "objects_id", "objects_conf", "attrs_id", "attrs_conf"):
        np.testing.assert_array_equal(getattr(again, name), getattr(singles[0], name))


def test_random_weights_are_identical_in_another_process_and_warn(small_detector):
    code = (
        "import hashlib, torch\n"
        "from extraction import Detector\n"
        "det = Detector.build(min_size=64, max_size=96)\n"
        "d = hashlib.sha256()\n"
        "for k, v in det.model.state_dict().items():\n"
        "    d.update(k.encode()); d.update(v.contiguous().numpy().tobytes())\n"
        "print(d.hexdigest())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert proc.stdout.strip() == state_hash(small_detector.model)
    assert "RANDOM weights" in proc.stderr and "meaningless" in proc.stderr


def test_all_rules_and_fewer_regions_than_min_boxes_are_not_padded(small_detector, reselect, images):
    """8 proposals, min_boxes 20: every rule returns what exists, never fake regions."""
    for rule in ("caffe", "maxnms", "threshold"):
        rec = reselect(small_detector, rule=rule, min_boxes=20, max_boxes=20).detect(images[:1])[0]
        check_record(rec, *SIZES[0], max_boxes=20)
        assert 1 <= rec.num_boxes <= (8 if rule != "threshold" else 20)
        if rule != "threshold":
            assert len({tuple(b) for b in rec.boxes.tolist()}) == rec.num_boxes


def test_bad_build_arguments_are_named():
    with pytest.raises(ValueError, match="min_sise"):
        Detector.build(min_sise=64)
    with pytest.raises(ValueError, match="unknown detector preset"):
        Detector.build(preset="r50")
    with pytest.raises(ValueError, match="selection rule"):
        Detector.build(selection="best")


def test_weights_file_builds_the_same_detector(small_detector, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "detector.safetensors"
    save_file({k: v.contiguous() for k, v in small_detector.model.state_dict().items()}, str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no random-weights warning
        det = Detector.build(weights=path, min_size=64, max_size=96, post_nms_topk=8)
    assert state_hash(det.model) == state_hash(small_detector.model)
    prov = det.provenance()
    assert prov["weights"] == str(path)
    assert prov["weights_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_real_preset_size(make_image):
    """600/1000 resize of a 480x640 image (res4 38x50); few proposals to keep the ROI head affordable."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        det = Detector.build(post_nms_topk=6, min_boxes=2, max_boxes=6)
    assert (det.config.min_size, det.config.max_size) == (600, 1000)
    timings: dict[str, float] = {}
    rec = det.detect([make_image(7, 480, 640)], timings=timings)[0]
    check_record(rec, 480, 640, max_boxes=6)
    assert 2 <= rec.num_boxes <= 6
    assert set(timings) == {"preprocess", "backbone", "rpn", "roi_head", "selection"}
    assert rec.boxes[:, 2].max() > 96  # boxes come back in original pixels, beyond the small test size
