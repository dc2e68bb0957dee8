"""Extraction on CUDA (skipped without a GPU): batched records bit for bit the same alone or in any batch,
two runs bit for bit, float32 on the GPU equal to the CPU's per-image path up to rounding (the same
regions, features within 1e-5 relative), and float32 convolutions laid out NCHW.

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
