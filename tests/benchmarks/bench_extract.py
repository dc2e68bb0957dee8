"""Extraction throughput: an in-process Detector loop vs `xmodal extract` (Ray) with 1 and 2 replicas.

Prints a table and one JSON line. `ratio` = Ray with 1 replica / in-process loop, in steady-state images/s
(>1 better; Ray's overhead at equal replicas = 1 - ratio, target < 10%; the loop runs before and after
the Ray runs and the faster of the two is the reference). Startup (ray.init, replica build)
is reported apart: it is paid once per job, not per image. On a machine with a GPU the replicas and the
loop run on it and decoding overlaps detection in the Ray job.

    python tests/benchmarks/bench_extract.py            # full network, 480x360 images (shortest side 360)
    python tests/benchmarks/bench_extract.py --quick    # tiny network, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

QUICK = dict(min_size=64, max_size=96, post_nms_topk=12, pooler_resolution=1, blocks_per_stage=(1, 1, 1))
FULL = dict(min_size=360, max_size=480)


def make_images(folder: Path, n: int, size: tuple[int, int]) -> None:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        pixels = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img_{i:05d}.jpg", quality=90)


def in_process(folder: Path, overrides: dict, batch_size: int, device: str) -> dict:
    """The reference: one Detector in this process, decode then detect, batch after batch."""
    from extraction import Detector, load_image

    det = Detector.build(min_boxes=36, max_boxes=36, device=device, **overrides)
    paths = sorted(folder.iterdir())
    start = time.perf_counter()  # no warm-up call: the replicas' first batch is not warmed up either
    for i in range(0, len(paths), batch_size):
        chunk = paths[i : i + batch_size]
        det.detect([load_image(p) for p in chunk], [p.stem for p in chunk])
    seconds = time.perf_counter() - start
    return {"images_per_s": len(paths) / seconds, "seconds": seconds}


def with_ray(folder: Path, overrides: dict, batch_size: int, workers: int, out: Path) -> dict:
    from pipelines.jobs.extract.driver import ExtractConfig, run_extract

    cfg = ExtractConfig(
        inputs=[str(folder)],
        out=str(out),
        overrides=overrides,
        batch_size=batch_size,
        workers=workers,
        progress=False,
        include_dashboard=False,
    )
    summary = run_extract(cfg)
    return {
        "images_per_s": summary.images_per_s,
        "seconds": summary.elapsed_s,
        "startup_s": summary.startup_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny network and few images (a smoke run)")
    parser.add_argument(
        "--images", type=int, help="number of images (default: 12 on CPU, 128 on GPU; quick: 16)"
    )
    parser.add_argument("--batch-size", type=int, default=4)
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the random-weights warning, once per replica
    # Ray starts its workers at nice 15; on a shared machine that alone would slow the replicas down
    # against everything else, so they run at this process's priority, as the in-process loop does.
    os.environ.setdefault("RAY_worker_niceness", "0")

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    overrides = QUICK if args.quick else FULL
    n = args.images or (16 if args.quick else 12 if device == "cpu" else 128)
    size = (96, 72) if args.quick else (480, 360)
    work = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    try:
        folder = work / "images"
        make_images(folder, n, size)
        rows = {"in-process loop (before)": in_process(folder, overrides, args.batch_size, device)}
        replicas = (1, 2) if device == "cpu" else (torch.cuda.device_count(),)
        for workers in replicas:
            rows[f"xmodal extract, {workers} replica(s)"] = with_ray(
                folder, overrides, args.batch_size, workers, work / f"feats{workers}.lmdb"
            )
        # again at the end: on a shared machine the load drifts; the better of the two is the reference
        rows["in-process loop (after)"] = in_process(folder, overrides, args.batch_size, device)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    reference = max(v["images_per_s"] for k, v in rows.items() if k.startswith("in-process"))
    print(f"{'run':<32} {'images/s':>9} {'seconds':>8} {'startup s':>10} {'vs loop':>8}")
    for name, row in rows.items():
        startup = f"{row['startup_s']:.1f}" if "startup_s" in row else "-"
        speed = row["images_per_s"]
        print(f"{name:<32} {speed:>9.3f} {row['seconds']:>8.1f} {startup:>10} {speed / reference:>8.2f}")
    ray_one = next(v for k, v in rows.items() if k.startswith("xmodal"))["images_per_s"]
    result = {
        "name": "extract",
        "device": f"{device} ({platform.machine()}, {torch.get_num_threads()} torch threads)",
        "images": n,
        "image_size": list(size),
        "overrides": overrides,
        "batch_size": args.batch_size,
        **{name: round(row["images_per_s"], 4) for name, row in rows.items()},
        "reference_images_per_s": round(reference, 4),
        "ray_overhead": round(1 - ray_one / reference, 4),
        "ratio": round(ray_one / reference, 4),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
