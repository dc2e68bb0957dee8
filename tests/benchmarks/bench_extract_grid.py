"""Grid vs region extraction: the same detector and weights, the same images, one run.

    python tests/benchmarks/bench_extract_grid.py                   # CPU, the release's 600/1000
    python tests/benchmarks/bench_extract_grid.py --device cuda     # GPU

Every side is `Detector.detect` on one image at a time (decoded image in, stored record out: resize,
network, selection or pooling), alternating image by image after a warm-up image each, so that load on
a shared machine falls on all. Regions: stem -> res4, RPN (300 proposals), res5 on each proposal's 14x14
RoI, caffe selection of 36. Grid: stem -> res4, res5 once over the whole res4 map, pooled to each --grid:
`native/1@32` is grid-feats-vqa's extraction (res5 at stride 32: every other row and column of the
stride-16 map), `14x14@32` Show-Attend-Tell's cells from that map, `14x14` and `native/2` from the
stride-16 map. `ratio` = region s/image / the first grid's s/image (>1: grid faster); `grids` has each.
Random weights: the timings are representative (the work does not depend on the weights' values), the
features are not.

Each side's arithmetic is also counted on one image (torch's FlopCounterMode: convolutions and matrix
products, 2 per multiply-add): `flop_ratio` = region GFLOP / grid GFLOP. Where the network is compute
bound (a CPU), the time ratio cannot exceed it by much: both sides share the stem -> res4 trunk.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import cv2
import numpy as np
import torch

from extraction import Detector
from extraction.grid import GridConfig

# grid-feats-vqa's own extraction (res5 at stride 32, unpooled), then the stride-16 grids
DEFAULT_GRIDS = ("native/1@32", "14x14@32", "14x14", "native/2")


def synthetic_images(n: int, h: int = 480, w: int = 640) -> list[np.ndarray]:
    """COCO-sized smooth random pictures (BGR uint8)."""
    rng = np.random.default_rng(0)
    small = [rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8) for _ in range(n)]
    return [cv2.resize(s, (w, h), interpolation=cv2.INTER_CUBIC) for s in small]


def timed(det: Detector, image: np.ndarray, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    det.detect([image], ["x"])
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def gflop(det: Detector, image: np.ndarray) -> float:
    """Convolution and matrix-product GFLOP of one `detect` call (2 FLOP per multiply-add)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        det.detect([image], ["x"])
    return counter.get_total_flops() / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--images", type=int, default=3, help="timed images per side")
    parser.add_argument(
        "--grid",
        default=",".join(DEFAULT_GRIDS),
        help="comma-separated grids, one side each; `ratio` is the first's (default: grid-feats-vqa's own "
        "extraction, res5 at stride 32 unpooled, then the stride-16 grids)",
    )
    parser.add_argument("--min-size", type=int, default=600)
    parser.add_argument("--max-size", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [g.strip() for g in args.grid.split(",") if g.strip()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        regions = Detector.build(device=args.device, min_size=args.min_size, max_size=args.max_size)
    # one network, so every side runs the same weights
    sides = {"regions": regions}
    for spec in specs:
        sides[spec] = Detector(
            regions.model,
            regions.config,
            regions.selection,
            regions.preset,
            regions._weights,
            grid=GridConfig.parse(spec),
        )
    images = synthetic_images(args.images + 1)
    with torch.inference_mode():
        for det in sides.values():
            det.detect(images[:1], ["warm-up"])
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        for i, image in enumerate(images[1:]):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for name in order:
                seconds[name].append(timed(sides[name], image, args.device))
        flops = {name: gflop(det, images[1]) for name, det in sides.items()}
    per_image = {name: float(np.mean(s)) for name, s in seconds.items()}
    records = {
        name: det.detect(images[:1], ["x"])[0].num_boxes if det.grid is not None else det.selection.max_boxes
        for name, det in sides.items()
    }
    ratios = {spec: per_image["regions"] / per_image[spec] for spec in specs}
    device = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu x{torch.get_num_threads()}"
    )

    print(f"{'side':<14}{'s/image':>10}{'GFLOP':>10}{'records':>10}{'speed-up':>10}")
    for name in sides:
        speed_up = f"{ratios[name]:.2f}x" if name in ratios else ""
        print(f"{name:<14}{per_image[name]:>10.3f}{flops[name]:>10.1f}{records[name]:>10}{speed_up:>10}")
    head = specs[0]
    print(
        json.dumps(
            {
                "name": "extract_grid_vs_regions",
                "device": device,
                "input": f"{args.min_size}/{args.max_size}",
                "grid": head,
                "images": args.images,
                "region_s_per_image": round(per_image["regions"], 4),
                "grid_s_per_image": round(per_image[head], 4),
                "region_gflop": round(flops["regions"], 1),
                "grid_gflop": round(flops[head], 1),
                "flop_ratio": round(flops["regions"] / flops[head], 2),
                "ratio": round(ratios[head], 2),
                "grids": {
                    spec: {
                        "s_per_image": round(per_image[spec], 4),
                        "gflop": round(flops[spec], 1),
                        "cells": records[spec],
                        "ratio": round(ratios[spec], 2),
                    }
                    for spec in specs
                },
                "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            }
        )
    )


if __name__ == "__main__":
    main()
