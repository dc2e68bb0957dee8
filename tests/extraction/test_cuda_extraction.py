"""Extraction on CUDA (skipped without a GPU): batched records bit for bit the same alone or in any batch,
two runs bit for bit, float32 on the GPU equal to the CPU's per-image path up to rounding (the same
regions, features within 1e-5 relative), float32 convolutions laid out NCHW, and the batched caffe
selection equal to the per-image one bit for bit with one host sync per batch.

Runs under pytest, or as a script where pytest is missing (the lent GPU machine):
`python tests/extraction/test_cuda_extraction.py` (tests/benchmarks/gpu_extract.sh does)."""

from __future__ import annotations

import sys
import traceback
import warnings

import cv2
import numpy as np
import torch

try:
    import pytest
except ImportError:  # run as a script on a machine without pytest
    pytest = None

from extraction import Detector
from extraction.postprocess import to_record, to_records
from extraction.preprocess import batch_images, resize_image
from extraction.selection import SelectionConfig, nms_suppression, select_caffe, select_caffe_batched

FIELDS = ("boxes", "features", "objects_id", "objects_conf", "attrs_id", "attrs_conf")
SHAPES = ((480, 640), (640, 480), (427, 640), (480, 640), (375, 500))
REL_TOL = 1e-5
BOX_TOL = 1e-3  # pixels

if pytest is not None:
    pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _images() -> list[np.ndarray]:
    images = []
    for seed, (h, w) in enumerate(SHAPES):
        rng = np.random.default_rng(seed)
        small = rng.integers(0, 256, size=(h // 16, w // 16, 3), dtype=np.uint8)
        images.append(cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC))
    return images


def _build(device: str, forward: str, dtype: str = "float32", **kw) -> Detector:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Detector.build(device=device, forward=forward, forward_batch=4, dtype=dtype, **kw)


def _same(a, b) -> bool:
    return a.img_id == b.img_id and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


def _same_regions(got, want) -> tuple[bool, float]:
    """(the same regions: classes equal and boxes within BOX_TOL px; features' relative difference)."""
    if got.boxes.shape != want.boxes.shape or not np.array_equal(got.objects_id, want.objects_id):
        return False, float("inf")
    if float(np.abs(got.boxes - want.boxes).max(initial=0.0)) > BOX_TOL:
        return False, float("inf")
    scale = max(float(np.abs(want.features).max(initial=0.0)), 1e-30)
    return True, float(np.abs(got.features - want.features).max(initial=0.0)) / scale


def test_cuda_batched_record_is_bitwise_the_same_alone_or_in_any_batch():
    images = _images()
    ids = [f"im{i}" for i in range(len(images))]
    for dtype in ("float32", "bfloat16"):
        det = _build("cuda", "batched", dtype)
        assert det.forward_path == "batched"
        alone = [det.detect([im], [i])[0] for im, i in zip(images, ids, strict=True)]
        for order in ([4, 0, 2, 1, 3], [1, 1, 3, 0], [3, 2]):
            got = det.detect([images[k] for k in order], [ids[k] for k in order])
            for k, rec in zip(order, got, strict=True):
                assert _same(rec, alone[k]), (dtype, order, k)


def test_cuda_two_runs_are_bitwise_the_same():
    images = _images()
    ids = [f"im{i}" for i in range(len(images))]
    for forward in ("per-image", "batched"):
        first = _build("cuda", forward).detect(images, ids)
        second = _build("cuda", forward).detect(images, ids)  # a second detector: cuDNN chooses again
        assert all(_same(a, b) for a, b in zip(first, second, strict=True)), forward


def test_cuda_float32_equals_the_cpu_per_image_path_up_to_rounding():
    images = _images()[:3]
    ids = [f"im{i}" for i in range(len(images))]
    want = _build("cpu", "per-image").detect(images, ids)
    for forward in ("per-image", "batched"):
        got = _build("cuda", forward).detect(images, ids)
        for g, w in zip(got, want, strict=True):
            same, rel = _same_regions(g, w)
            assert same and rel <= REL_TOL, (forward, g.img_id, rel)


def test_cuda_float32_convolutions_run_nchw_and_bfloat16_channels_last():
    for dtype, fmt in (("float32", torch.contiguous_format), ("bfloat16", torch.channels_last)):
        det = _build("cuda", "auto", dtype)
        weight = det.model.roi_heads.res5[0].conv2.folded_weight
        assert weight.is_cuda and weight.is_contiguous(memory_format=fmt), dtype
        assert det.model.roi_heads.memory_format == fmt and det.model.backbone.memory_format == fmt


def _caffe_tables(seed: int, images: int = 4, num: int = 300, classes: int = 1600) -> tuple[list, list]:
    """A batch's proposals and probabilities on CUDA: boxes on an 8 px grid with duplicates (IoUs at the
    thresholds), scores from a few levels (ties, values at the floors and thresholds) or softmaxed, the
    second image with fewer proposals."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.tensor([0.0, 0.001, 0.01, 0.05, 0.2, 0.3])
    proposals, probs = [], []
    for i in range(images):
        n = num // 3 if i == 1 else num
        xy = torch.randint(0, 40, (n, 2), generator=g) * 8.0
        boxes = torch.cat([xy, xy + torch.randint(1, 20, (n, 2), generator=g) * 8.0], 1)
        boxes[n // 2 :: 5] = boxes[: len(boxes[n // 2 :: 5])]
        p = levels[torch.randint(0, len(levels), (n, classes + 1), generator=g)]
        if i == 2:
            p = torch.softmax(torch.randn(n, classes + 1, generator=g) * 3, 1)
        proposals.append(boxes.cuda())
        probs.append(p.cuda())
    return proposals, probs


def test_cuda_batched_caffe_selection_equals_the_per_image_rule():
    proposals, probs = _caffe_tables(0)
    for cfg in (
        SelectionConfig(),
        SelectionConfig(min_boxes=10, max_boxes=100),
        SelectionConfig(conf_thresh=0.5),
    ):
        got = select_caffe_batched(proposals, probs, cfg)
        for i, (b, p) in enumerate(zip(proposals, probs, strict=True)):
            want = select_caffe(b, p, cfg)
            for field in ("index", "boxes", "classes", "scores"):
                assert torch.equal(getattr(got[i], field), getattr(want, field)), (cfg, i, field)


def test_cuda_suppression_compares_like_the_cuda_nms():
    """torchvision's CUDA kernel compares IoU with the threshold rounded to float32."""
    from torchvision.ops import nms

    x = float(torch.tensor(0.3, dtype=torch.float32))
    boxes = torch.tensor([[0, 0, 1, 1], [0, 0, x, 1]], device="cuda")
    kept = nms(boxes, torch.tensor([0.9, 0.8], device="cuda"), 0.3).tolist()
    assert bool(nms_suppression(boxes[None], 0.3)[0, 0, 1]) == (kept == [0])


def test_cuda_batched_caffe_selection_syncs_the_host_once():
    proposals, probs = _caffe_tables(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            select_caffe_batched(proposals, probs, SelectionConfig())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


def test_cuda_batched_selection_gives_the_per_image_records():
    det = _build("cuda", "batched")
    cfg = det.config
    images = _images()
    resized = [resize_image(im, cfg.min_size, cfg.max_size) for im in images]
    inputs = [batch_images([im], cfg.pixel_mean, cfg.pixel_std, det.device)[0][0] for im in resized]
    with torch.inference_mode():
        outs = det.model.forward_batched(inputs, batch_size=4, canvas_sides=(cfg.min_size, cfg.max_size))
        ids = [f"im{i}" for i in range(len(outs))]
        input_hws = [im.shape[:2] for im in resized]
        orig_hws = [im.shape[:2] for im in images]
        got = to_records(outs, ids, orig_hws, input_hws, det.selection, det._roi_coder)
        want = [
            to_record(*args, det.selection, det._roi_coder)
            for args in zip(outs, ids, orig_hws, input_hws, strict=True)
        ]
    assert all(_same(g, w) for g, w in zip(got, want, strict=True))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        sys.exit(0)
    failed = 0
    tests = [(name, fn) for name, fn in list(globals().items()) if name.startswith("test_") and callable(fn)]
    for name, fn in tests:
        try:
            fn()
            print(f"PASS {name}")
        except Exception:
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}")
    print(f"{len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
