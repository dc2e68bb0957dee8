"""What the batched extraction would launch on a GPU, counted on a CPU: dispatched ops per image and host
syncs per `detect` call at several batch sizes (the census of tests/extraction/test_census.py: R101-C4
depths, widths / 8, 300 proposals), and the CPU time per image of the batched forward with either
selection.

Prints a table and one JSON line; `ratio` = the ops-per-image budget / ops per image at batch 32 (>1
better: the budget holds with that margin).

    python tests/benchmarks/bench_census.py [--batches 1 8 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import time
from pathlib import Path

import torch

CENSUS = Path(__file__).resolve().parents[1] / "extraction" / "test_census.py"


def load_census():
    spec = importlib.util.spec_from_file_location("census", CENSUS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seconds_per_image(det, images) -> float:
    det.detect(images[:1])
    start = time.perf_counter()
    det.detect(images)
    return (time.perf_counter() - start) / len(images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args()
    census = load_census()
    torch.set_num_threads(2)
    rows = []
    for batch in args.batches:
        det = census.census_detector(batch)
        images = census.census_images(batch)
        det.detect(images[:1])
        counted, _ = census.count(det, images)
        batched_s = seconds_per_image(det, images)
        det.fixed_shapes = False  # the batched forward's CPU default: torchvision's nms, per-image selection
        per_image_sel_s = seconds_per_image(det, images)
        rows.append(
            {
                "batch": batch,
                "ops_per_image": sum(counted.ops.values()) / batch,
                "syncs_per_batch": sum(counted.syncs.values()),
                "ms_per_image_fixed_shapes": 1000 * batched_s,
                "ms_per_image_cpu_default": 1000 * per_image_sel_s,
            }
        )
    heads = ("batch", "ops/image", "syncs/batch", "ms/img (fixed shapes)", "ms/img (CPU default)")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (5, 10, 12, 22, 24), strict=True)))
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ops_per_image']:>10.0f} {r['syncs_per_batch']:>12d} "
            f"{r['ms_per_image_fixed_shapes']:>22.0f} {r['ms_per_image_cpu_default']:>24.0f}"
        )
    at_budget = next((r for r in rows if r["batch"] == census.BUDGET_BATCH), rows[-1])
    result = {
        "name": "extract_census",
        "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} torch threads)",
        "rows": rows,
        "budget_ops_per_image": census.OPS_PER_IMAGE,
        "budget_syncs_per_batch": census.SYNCS_PER_BATCH,
        "ratio": census.OPS_PER_IMAGE / at_budget["ops_per_image"],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
