"""Extraction as users run it on a GPU: JPEG files on disk -> decoders (resize to the working size) ->
the detector -> a written store, float32 (TF32 off) and bfloat16, plus the `Detector` API alone and its
stage split. Prints a table and one JSON line.

The files-to-store run goes through `xmodal extract` (Ray) where Ray is installed and `--via` allows it,
else through the replica's own code in this process (`Replica.detect` on batches that decoder threads
read and resize ahead of it, records written to an LMDB store as the driver writes them): the lent GPU
machine has no Ray. `--compare` checks the float32 store against the per-image path on CPU (the
reference): the same boxes, features within 1e-5 relative.

    python tests/benchmarks/bench_extract_gpu.py --device cpu --quick     # correctness smoke, < 2 min
    python tests/benchmarks/bench_extract_gpu.py --device cuda --compare  # R101-C4 600/1000, 300 RoIs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

# full: LXMERT's extraction settings (600/1000, 300 proposals, 36 regions) on 480x640 photos' shapes
FULL = dict(preset="vg-r101-c4", overrides={}, image_size=(640, 480), images=64, batch_size=8)
# quick: the small C4 network on small images, for correctness on CPU in seconds
QUICK = dict(
    preset="c4-small",
    overrides=dict(min_size=96, max_size=160, post_nms_topk=50),
    image_size=(200, 150),
    images=8,
    batch_size=4,
)
DTYPES = ("float32", "bfloat16")
STAGE_ORDER = ("decode", "preprocess", "backbone", "rpn", "roi_head", "selection", "write")
REL_TOL = 1e-5  # features: max |difference| / max |feature| of the image
BOX_TOL = 1e-3  # pixels: the same region, its box rounded differently (proposals are regressed in float32)


def make_images(folder: Path, n: int, size: tuple[int, int]) -> list[Path]:
    """`n` JPEGs of smooth colour blobs (more structure than noise), every fourth one in portrait and
    every third one 3:4 wider, so the batches hold several canvas sizes."""
    import cv2

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        w, h = size
        if i % 4 == 3:
            w, h = h, w
        if i % 3 == 2:
            w = w * 4 // 3
        small = rng.integers(0, 256, size=(max(h // 16, 2), max(w // 16, 2), 3), dtype=np.uint8)
        pixels = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
        path = folder / f"img_{i:05d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(path)
    return paths


def build(setup: dict, device: str, dtype: str, forward: str, weights: str | None, batch_size: int):
    from extraction import Detector

    return Detector.build(
        setup["preset"],
        weights=weights,
        device=device,
        forward=forward,
        forward_batch=batch_size,
        dtype=dtype,
        **setup["overrides"],
    )


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def api_run(det, images: list, sizes: list, ids: list[str], batch_size: int, device: str) -> dict:
    """The Detector API alone on working-size arrays (decoding excluded): a warm-up pass (every canvas
    shape meets its kernels once), a timed pass for images/s, then a pass with per-stage timings (each
    stage synchronised, so a little slower)."""
    for i in range(0, len(images), batch_size):
        det.detect(
            images[i : i + batch_size], ids[i : i + batch_size], original_sizes=sizes[i : i + batch_size]
        )
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(images), batch_size):
        det.detect(
            images[i : i + batch_size], ids[i : i + batch_size], original_sizes=sizes[i : i + batch_size]
        )
    _sync(device)
    seconds = time.perf_counter() - start
    timings: dict[str, float] = {}
    for i in range(0, len(images), batch_size):
        det.detect(
            images[i : i + batch_size],
            ids[i : i + batch_size],
            timings=timings,
            original_sizes=sizes[i : i + batch_size],
        )
    stages = {k: round(1e3 * v / len(images), 3) for k, v in timings.items()}
    return {"images_per_s": len(images) / seconds, "stages_ms": stages}


def files_in_process(det, paths: list[Path], out: Path, batch_size: int, decoders: int) -> dict:
    """Files -> store through the replica's code: decoder threads read and resize `decoders` batches
    ahead, `Replica.detect` runs each batch, the records go to an LMDB store as the driver writes them."""
    import torch

    from pipelines.jobs.extract.actors import Replica, decode_images
    from pipelines.jobs.image_inputs import ImageInput
    from storage import FeatureWriter

    class Around(Replica):
        """The replica's own code around the detector built above (not a second build)."""

        def build_detector(self, build: dict):
            return build["detector"]

    replica = Around({"detector": det}, torch.get_num_threads())
    working = (det.config.min_size, det.config.max_size)
    items = [ImageInput(p.stem, str(p)) for p in paths]
    batches = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
    decode_s = [0.0]

    def decode(batch):
        t0 = time.perf_counter()
        decoded = decode_images(batch, 60.0, working)
        decode_s[0] += time.perf_counter() - t0
        return decoded

    prov = det.provenance()
    writer = FeatureWriter(
        out, feature_dim=det.feature_dim, max_boxes=prov["max_boxes"], dtype="float32", meta=prov
    )
    write_s, done = 0.0, 0
    start = time.perf_counter()
    with ThreadPoolExecutor(decoders) as pool:
        pending = deque(pool.submit(decode, b) for b in batches[: 2 * decoders])
        queued = len(pending)
        while pending:
            decoded = pending.popleft().result()
            if queued < len(batches):
                pending.append(pool.submit(decode, batches[queued]))
                queued += 1
            records, failures = replica.detect(decoded)
            assert not failures, failures
            t0 = time.perf_counter()
            for rec in records:
                done += writer.put(rec)
            writer.flush()
            write_s += time.perf_counter() - t0
    writer.close()
    seconds = time.perf_counter() - start
    return {
        "images_per_s": done / seconds,
        "seconds": seconds,
        "decode_ms": 1e3 * decode_s[0] / len(paths),
        "write_ms": 1e3 * write_s / len(paths),
    }


def files_with_ray(setup: dict, folder: Path, out: Path, dtype: str, forward: str, weights, batch_size: int):
    from pipelines.jobs.extract.driver import ExtractConfig, run_extract

    cfg = ExtractConfig(
        inputs=[str(folder)],
        out=str(out),
        preset=setup["preset"],
        weights=weights,
        overrides={**setup["overrides"], "dtype": dtype},
        batch_size=batch_size,
        forward=forward,
        dtype="float32",
        progress=False,
        include_dashboard=False,
    )
    summary = run_extract(cfg)
    assert summary.done == summary.total, summary
    return {
        "images_per_s": summary.images_per_s,
        "seconds": summary.elapsed_s,
        "startup_s": summary.startup_s,
    }


def compare(store: Path, setup: dict, paths: list[Path], weights: str | None) -> dict:
    """The float32 store against the per-image path on CPU (the reference) over `paths`: images whose
    regions are the same (classes equal, boxes within BOX_TOL px), bit-identical ones, and the largest box
    and relative feature differences over the same regions."""
    from storage import FeatureReader

    ref = build(setup, "cpu", "float32", "per-image", weights, 1)
    want = ref.detect([str(p) for p in paths], [p.stem for p in paths])
    reader = FeatureReader(store)
    same, identical, box_diff, worst = 0, 0, 0.0, 0.0
    for exp in want:
        got = reader[exp.img_id]
        if got.boxes.shape != exp.boxes.shape or not np.array_equal(got.objects_id, exp.objects_id):
            continue
        diff = float(np.abs(got.boxes - exp.boxes).max(initial=0.0))
        if diff > BOX_TOL:
            continue
        same += 1
        identical += bool(np.array_equal(got.boxes, exp.boxes) and np.array_equal(got.features, exp.features))
        box_diff = max(box_diff, diff)
        scale = max(float(np.abs(exp.features).max(initial=0.0)), 1e-30)
        worst = max(worst, float(np.abs(got.features - exp.features).max(initial=0.0)) / scale)
    reader.close()
    return {
        "images": len(want),
        "same_regions": same,
        "bit_identical": identical,
        "max_box_diff_px": box_diff,
        "max_rel_feature_diff": worst,
        "ok": same == len(want) and worst <= REL_TOL,
    }


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu x{os.cpu_count()} ({torch.get_num_threads()} torch threads)"


def main() -> None:
    from extraction.rcnn import FORWARD_MODES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--quick", action="store_true", help="small network and images: correctness, not speed"
    )
    parser.add_argument("--images", type=int, help="JPEG files to extract (default: 64; quick: 8)")
    parser.add_argument("--batch-size", type=int, help="images per detector call (default: 8; quick: 4)")
    parser.add_argument("--forward", choices=FORWARD_MODES, default="auto", help="the detector's path")
    parser.add_argument("--decoders", type=int, default=4, help="decoder threads (in-process run)")
    parser.add_argument("--via", choices=("auto", "ray", "in-process"), default="auto", help="files -> store")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated compute dtypes")
    parser.add_argument("--weights", help="detector weights (default: random, seed 0)")
    parser.add_argument(
        "--compare", action="store_true", help="check the float32 store against CPU per-image"
    )
    parser.add_argument("--compare-images", type=int, default=8, help="images the comparison covers")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the random-weights warning
    os.environ.setdefault("RAY_worker_niceness", "0")

    import torch

    from extraction.preprocess import load_image, resize_image

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    setup = dict(QUICK if args.quick else FULL)
    n = args.images or setup["images"]
    batch_size = args.batch_size or setup["batch_size"]
    via = args.via
    if via == "auto":
        try:
            import ray  # noqa: F401

            via = "ray" if not args.quick else "in-process"  # quick: no Ray start-up in a 2-minute smoke run
        except ImportError:
            via = "in-process"
    dtypes = [d for d in args.dtypes.split(",") if d]
    work = Path(tempfile.mkdtemp(prefix="bench_extract_gpu_"))
    rows, result_stages = {}, {}
    try:
        paths = make_images(work / "images", n, setup["image_size"])
        comparison = None
        for dtype in dtypes:
            det = build(setup, device, dtype, args.forward, args.weights, batch_size)
            cfg = det.config
            originals = [load_image(p) for p in paths]
            images = [resize_image(im, cfg.min_size, cfg.max_size) for im in originals]
            sizes = [im.shape[:2] for im in originals]
            api = api_run(det, images, sizes, [p.stem for p in paths], batch_size, device)
            store = work / f"{dtype}.lmdb"
            if via == "ray":
                files = files_with_ray(
                    setup, work / "images", store, dtype, args.forward, args.weights, batch_size
                )
                files.update(decode_ms=None, write_ms=None)
            else:
                files = files_in_process(det, paths, store, batch_size, args.decoders)
            stages = {"decode": files["decode_ms"], **api["stages_ms"], "write": files["write_ms"]}
            result_stages[dtype] = {k: stages[k] for k in STAGE_ORDER if stages.get(k) is not None}
            rows[dtype] = {
                "files": files["images_per_s"],
                "api": api["images_per_s"],
                "path": det.forward_path,
            }
            # as it comes, so that a run cut short by its time limit still says what it measured
            print(
                f"# {dtype}: {json.dumps(rows[dtype])} stages {json.dumps(result_stages[dtype])}", flush=True
            )
            if dtype == "float32" and args.compare:
                comparison = compare(store, setup, paths[: args.compare_images], args.weights)
            del det
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"device: {device_name(device)}; forward {args.forward}; files -> store via {via}; batch {batch_size}"
    )
    print(f"{'dtype':<10} {'path':<10} {'files img/s':>12} {'API img/s':>10}   stages ms/img")
    for dtype, row in rows.items():
        split = " ".join(f"{k} {v:.1f}" for k, v in result_stages[dtype].items())
        print(f"{dtype:<10} {row['path']:<10} {row['files']:>12.2f} {row['api']:>10.2f}   {split}")
    if comparison is not None:
        print(
            f"compare (float32 store vs CPU per-image, {comparison['images']} images): same regions "
            f"{comparison['same_regions']}/{comparison['images']} "
            f"({comparison['bit_identical']} bit-identical), "
            f"max box difference {comparison['max_box_diff_px']:.1e} px, max relative feature difference "
            f"{comparison['max_rel_feature_diff']:.2e} -> {'OK' if comparison['ok'] else 'DIFFERENT'}"
        )
    result = {
        "name": "extract_gpu",
        "device": device_name(device),
        "float32_img_per_s": round(rows["float32"]["files"], 3) if "float32" in rows else None,
        "bfloat16_img_per_s": round(rows["bfloat16"]["files"], 3) if "bfloat16" in rows else None,
        "api_img_per_s": {d: round(r["api"], 3) for d, r in rows.items()},
        "stages": {d: {k: round(v, 3) for k, v in s.items()} for d, s in result_stages.items()},
        "forward": args.forward,
        "path": {d: r["path"] for d, r in rows.items()},
        "via": via,
        "preset": setup["preset"],
        "overrides": setup["overrides"],
        "images": n,
        "batch_size": batch_size,
        "decoders": args.decoders,
        "compare": comparison,
        "torch": torch.__version__,
        "load_average": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))
    if comparison is not None and not comparison["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
