"""Detector end to end on random weights: fields, batch invariance, determinism, honesty, provenance."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extraction import Detector
from extraction.backbone import Conv2d
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


def check_record(
    rec: RegionFeatures,
    h: int,
    w: int,
    max_boxes: int,
    feature_dim: int = 2048,
    classes: int = 1600,
    attributes: int = 400,
) -> None:
    rec.validate(feature_dim=feature_dim, max_boxes=max_boxes)
    assert (rec.img_h, rec.img_w) == (h, w)
    assert rec.features.dtype == np.float32 and rec.features.shape == (rec.num_boxes, feature_dim)
    assert rec.boxes.dtype == np.float32 and rec.objects_conf.dtype == np.float32
    assert rec.attrs_conf.dtype == np.float32
    assert rec.objects_id.dtype == np.int64 and rec.attrs_id.dtype == np.int64
    assert ((rec.objects_id >= 0) & (rec.objects_id < classes)).all()
    assert ((rec.attrs_id >= 0) & (rec.attrs_id < attributes)).all()
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


FIELDS = ("boxes", "features", "objects_id", "objects_conf", "attrs_id", "attrs_conf")


def assert_same_records(a: RegionFeatures, b: RegionFeatures) -> None:
    assert (a.img_id, a.img_h, a.img_w) == (b.img_id, b.img_h, b.img_w)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"{a.img_id} {name}")


def test_batch_equals_one_image_at_a_time(batched, singles):
    for alone, rec in zip(singles, batched, strict=True):
        assert_same_records(alone, rec)


def flat_images() -> list[np.ndarray]:
    """Flat backgrounds with one or two plain rectangles: many near-tied proposals, various shapes."""
    rng = np.random.default_rng(5)
    images = []
    for h, w in [(70, 50), (50, 90), (64, 64), (96, 40), (40, 96), (81, 77), (64, 80), (55, 60)]:
        image = np.full((h, w, 3), rng.integers(0, 256, 3), np.uint8)
        for _ in range(rng.integers(1, 3)):
            y, x = rng.integers(0, h // 2), rng.integers(0, w // 2)
            image[y : y + rng.integers(8, h // 2), x : x + rng.integers(8, w // 2)] = rng.integers(0, 256, 3)
        images.append(image)
    return images


@pytest.fixture(scope="module")
def flat_detector() -> Detector:
    """The full R101 trunk on small inputs, 16 proposals, a 2x2 RoI pool (keeps res5 cheap)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Detector.build(
            min_boxes=4, max_boxes=8, min_size=64, max_size=96, post_nms_topk=16, pooler_resolution=2
        )


def test_regions_are_bit_identical_whatever_the_batch_mates(flat_detector):
    """Batches of 1, 2, 4 and 8 (and a shuffled 8): every image's records are equal bit for bit."""
    det = flat_detector
    images, ids = flat_images(), [f"flat{i}" for i in range(8)]
    alone = {i: det.detect([im], ids=[i])[0] for im, i in zip(images, ids, strict=True)}
    order = [3, 7, 0, 5, 1, 6, 2, 4]
    for batch, picks in [(2, range(8)), (4, range(8)), (8, range(8)), (8, order)]:
        picks = list(picks)
        for start in range(0, 8, batch):
            chunk = picks[start : start + batch]
            got = det.detect([images[i] for i in chunk], ids=[ids[i] for i in chunk])
            for rec in got:
                assert_same_records(rec, alone[rec.img_id])


def test_same_regions_and_features_as_detectron2_arithmetic(small_detector, images, singles, monkeypatch):
    """Folded norms and channels-last change only the rounding: conv -> F.batch_norm (detectron2's
    FrozenBatchNorm2d at inference, NCHW) selects the same regions with features within 1e-4."""

    def d2_forward(conv: Conv2d, x: torch.Tensor) -> torch.Tensor:
        y = F.conv2d(x.contiguous(), conv.weight, None, conv.stride, conv.padding, conv.dilation)
        n = conv.norm
        return F.batch_norm(y, n.running_mean, n.running_var, n.weight, n.bias, False, 0.0, n.eps)

    monkeypatch.setattr(Conv2d, "forward", d2_forward)
    reference = small_detector.detect(images, ids=["a", "b", "c"])
    for ref, rec in zip(reference, singles, strict=True):
        np.testing.assert_array_equal(ref.objects_id, rec.objects_id)
        np.testing.assert_array_equal(ref.attrs_id, rec.attrs_id)
        np.testing.assert_allclose(ref.boxes, rec.boxes, rtol=1e-4, atol=1e-3)
        scale = np.abs(ref.features).max()
        assert np.abs(ref.features - rec.features).max() <= 1e-4 * scale


def test_bfloat16_runs_the_convolutions_in_bf16_and_the_rest_in_float32(make_image):
    narrow = {"res2_channels": 64, "bottleneck_channels": 16, "blocks_per_stage": [1, 1, 1], "res5_blocks": 1}
    kwargs = {"num_classes": 10, "num_attributes": 5, "min_size": 64, "max_size": 96, "post_nms_topk": 8}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp32 = Detector.build(min_boxes=2, max_boxes=4, **narrow, **kwargs)
        bf16 = Detector.build(min_boxes=2, max_boxes=4, dtype="bfloat16", **narrow, **kwargs)
    rec = bf16.detect([make_image(3, 60, 80)])[0]
    check_record(rec, 60, 80, max_boxes=4, feature_dim=512, classes=10, attributes=5)
    features = bf16.model.backbone(torch.randn(1, 3, 64, 80))
    boxes = torch.tensor([[0.0, 0.0, 40.0, 40.0], [20.0, 10.0, 80.0, 64.0]])
    with torch.inference_mode():
        exact = fp32.model.roi_heads(features, boxes)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = bf16.model.roi_heads(features, boxes)
    for name in ("features", "cls_logits", "deltas", "attr_logits"):
        assert getattr(low, name).dtype == torch.float32, name
    assert not torch.equal(low.features, exact.features)  # the convolutions did run in bf16
    cosine = F.cosine_similarity(low.features, exact.features, dim=1)
    assert bool((cosine > 0.99).all()), cosine


def test_detection_from_a_path_repeats_exactly(small_detector, images, singles, tmp_path):
    import cv2

    path = tmp_path / "a.png"
    cv2.imwrite(str(path), images[0])
    again = small_detector.detect([path])[0]
    assert_same_records(again, singles[0])


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


def test_class_probs_are_stored_when_asked(small_detector, reselect, make_image, tmp_path):
    """`class_probs=True` (`xmodal extract --store-class-probs`): each region's distribution over every
    class, background last, goes into the store and comes back (float16)."""
    from storage import FeatureReader, FeatureWriter

    det = reselect(small_detector, class_probs=True)
    rec = det.detect([make_image(3, 40, 56)], ids=["x"])[0]
    classes = det.model.roi_heads.box_predictor.cls_score.out_features
    assert rec.class_probs.shape == (rec.num_boxes, classes)
    np.testing.assert_allclose(rec.class_probs.sum(1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(rec.class_probs[np.arange(rec.num_boxes), rec.objects_id], rec.objects_conf)
    assert small_detector.detect([make_image(3, 40, 56)], ids=["x"])[0].class_probs is None
    with FeatureWriter(tmp_path / "f.lmdb", feature_dim=rec.features.shape[1], max_boxes=6) as writer:
        writer.put(rec)
    back = FeatureReader(tmp_path / "f.lmdb")["x"].class_probs
    np.testing.assert_allclose(back, rec.class_probs, atol=1e-3)
