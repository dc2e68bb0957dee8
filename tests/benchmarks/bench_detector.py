"""Detector throughput: images/s and per-stage time at the vg-r101-c4 preset, by batch size and dtype.

    .venv/bin/python tests/benchmarks/bench_detector.py            # realistic: 300 proposals, batch 1 and 4
                                                                   # (CPU; GPU: fp32/fp16 at batch 1, 4, 8)
    .venv/bin/python tests/benchmarks/bench_detector.py --quick    # batch 1 and 2, 50 proposals, one pass

`ratio` = images/s at the largest batch / images/s at batch 1 (the gain from batching, >1 better).
`selection_ratio` = caffe rule with the score floor / the reference's 1600 NMS runs (>1 better).
Random weights: timings are representative, the regions are not.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import cv2
import numpy as np
import torch
from torchvision.ops import nms

from extraction import Detector
from extraction.config import SelectionConfig
from extraction.detector import STAGES
from extraction.selection import select_caffe


def synthetic_images(n: int, h: int = 480, w: int = 640) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        cv2.resize(
            rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8), (w, h), interpolation=cv2.INTER_CUBIC
        )
        for _ in range(n)
    ]


def time_detector(det: Detector, batch: int, reps: int) -> dict:
    images = synthetic_images(batch)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    for _ in range(reps):
        det.detect(images, timings=timings)
    total = time.perf_counter() - start
    n = batch * reps
    return {"batch": batch, "images_per_s": n / total, **{f"{k}_ms": 1000 * timings[k] / n for k in STAGES}}


def time_selection(proposals: int = 300, classes: int = 1600, reps: int = 3) -> tuple[float, float]:
    """(ours, reference) seconds for the caffe rule on a random score table."""
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(proposals, 2, generator=g) * 600
    boxes = torch.cat([xy, xy + torch.rand(proposals, 2, generator=g) * 300 + 8], dim=1)
    probs = torch.softmax(torch.randn(proposals, classes + 1, generator=g) * 2.5, dim=1)
    cfg = SelectionConfig()
    start = time.perf_counter()
    for _ in range(reps):
        select_caffe(boxes, probs, cfg)
    ours = (time.perf_counter() - start) / reps
    start = time.perf_counter()
    max_conf = torch.zeros(proposals)
    for c in range(classes):  # bottom-up-attention generate_tsv: one NMS per class
        keep = nms(boxes, probs[:, c], cfg.nms_thresh)
        max_conf[keep] = torch.maximum(max_conf[keep], probs[keep, c])
    return ours, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="batch 1 and 2, 50 proposals, one pass")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=None, help="timed passes per setting")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    batches = (1, 2) if args.quick else ((1, 4, 8) if cuda else (1, 4))
    dtypes = ("float32", "float16") if cuda else ("float32",)
    reps = args.reps or (3 if cuda and not args.quick else 1)
    overrides = {"post_nms_topk": 50} if args.quick else {}

    rows = []
    for dtype in dtypes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            det = Detector.build(device=args.device, dtype=dtype, **overrides)
        det.detect(synthetic_images(1))  # warm-up: first-call kernel selection and allocations
        for batch in batches:
            rows.append({"dtype": dtype, **time_detector(det, batch, reps)})
    ours, reference = time_selection()

    device = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    print(f"detector vg-r101-c4 (600/1000, {overrides.get('post_nms_topk', 300)} proposals) on {device}")
    header = ["dtype", "batch", "images_per_s", *(f"{k}_ms" for k in STAGES)]
    print("  ".join(f"{h:>14}" for h in header))
    for row in rows:
        print("  ".join(f"{row[h]:>14.3f}" if isinstance(row[h], float) else f"{row[h]:>14}" for h in header))
    print(
        f"caffe selection (300 x 1600): {1000 * ours:.1f} ms vs per-class NMS loop {1000 * reference:.1f} ms"
    )
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    print(
        json.dumps(
            {
                "name": "detector",
                "device": device,
                "quick": args.quick,
                "proposals": overrides.get("post_nms_topk", 300),
                "rows": rows,
                "images_per_s_batch1": fp32[0]["images_per_s"],
                "images_per_s_max_batch": fp32[-1]["images_per_s"],
                "ratio": fp32[-1]["images_per_s"] / fp32[0]["images_per_s"],
                "selection_ms": 1000 * ours,
                "selection_reference_ms": 1000 * reference,
                "selection_ratio": reference / ours,
            }
        )
    )


if __name__ == "__main__":
    main()
