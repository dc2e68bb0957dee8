"""Grid vs region extraction: the same detector and weights, the same images, one run.

    python tests/benchmarks/bench_extract_grid.py                   # CPU, the release's 600/1000
    python tests/benchmarks/bench_extract_grid.py --device cuda     # GPU

Both sides are `Detector.detect` on one image at a time (decoded image in, stored record out: resize,
network, selection or pooling), alternating image by image after a warm-up image each, so that load on
a shared machine falls on both. Regions: stem -> res4, RPN (300 proposals), res5 on each proposal's 14x14
RoI, caffe selection of 36. Grid: stem -> res4, res5 once over the whole res4 map, pooled to --grid.
`ratio` = region s/image / grid s/image (>1: grid faster). Random weights: the timings are
representative (the work does not depend on the weights' values), the features are not.

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
    parser.add_argument("--grid", default="14x14", help="grid of the grid side (14x14 or native/2)")
    parser.add_argument("--min-size", type=int, default=600)
    parser.add_argument("--max-size", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        regions = Detector.build(device=args.device, min_size=args.min_size, max_size=args.max_size)
    # one network, so both sides run the same weights
    grid = Detector(
        regions.model,
        regions.config,
        regions.selection,
        regions.preset,
        regions._weights,
        grid=GridConfig.parse(args.grid),
    )
    sides = {"regions": regions, "grid": grid}
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
    cells = grid.detect(images[:1], ["x"])[0].num_boxes
    device = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu x{torch.get_num_threads()}"
    )

    print(f"{'side':<10}{'s/image':>10}{'GFLOP':>10}{'records':>10}")
    print(
        f"{'regions':<10}{per_image['regions']:>10.3f}{flops['regions']:>10.1f}{regions.selection.max_boxes:>10}"
    )
    print(f"{'grid':<10}{per_image['grid']:>10.3f}{flops['grid']:>10.1f}{cells:>10}")
    print(
        json.dumps(
            {
                "name": "extract_grid_vs_regions",
                "device": device,
                "input": f"{args.min_size}/{args.max_size}",
                "grid": args.grid,
                "images": args.images,
                "region_s_per_image": round(per_image["regions"], 4),
                "grid_s_per_image": round(per_image["grid"], 4),
                "region_gflop": round(flops["regions"], 1),
                "grid_gflop": round(flops["grid"], 1),
                "flop_ratio": round(flops["regions"] / flops["grid"], 2),
                "ratio": round(per_image["regions"] / per_image["grid"], 2),
                "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            }
        )
    )


if __name__ == "__main__":
    main()
