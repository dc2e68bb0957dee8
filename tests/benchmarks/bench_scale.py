"""Training input at the size users work at: a feature store larger than RAM read cold, against the disk.

Writes a store of `--gb` (default 1.2 x RAM) of 36 x 2048 float16 records with `FeatureWriter` (eight
random records encoded once, each written under many ids with one value per 4 KB changed), or measures
one an earlier `--keep` run left (`--store`), then in the same run:

- the disk's own random-read rate on that data.mdb: O_DIRECT reads of one record's pages (148 KB, page
  aligned, at random record offsets) by 1 and 4 threads, records/s (the page cache is bypassed);
- records/s delivered through the trainer's input path (VQA questions, one per image, in random order:
  `VQATask.train_dataset` -> `BatchDataset` -> torch `DataLoader` workers as the trainer builds them,
  batches of 256, each a `FeatureReader.read_batch` of 256 random images) by 1, 2 and 4 loader processes,
  cold: the page cache dropped before each (`sync; echo 3 > /proc/sys/vm/drop_caches`, root only;
  otherwise the figures say so and, on a store larger than RAM, are mostly cold anyway), and warm: the
  same batches read a second time by one loader process. Rates count from the first batch delivered
  (worker start-up is paid once per epoch);
- the trainer's start-up check of every record the run reads (storage.checks: file order, pages
  requested together), cold, and again on the unchanged store (from what the first one remembered);
- the corpus figures (tests/benchmarks/scale_corpus.py `measure_corpus`, when present) for `--pairs`.

`ratio` = cold records/s of one loader process / (0.5 x the disk's 1-thread rate): the target, one loader
process reading at least half the disk's single-stream random rate, is met at >= 1; `ratio_4` likewise
= cold rate of 4 loader processes / (0.8 x the disk's 4-thread rate). Prints a table and one JSON line.
The store is deleted at the end unless `--keep`.

    .venv/bin/python tests/benchmarks/bench_scale.py                 # 1.2 x RAM, 9.18 M pairs
    .venv/bin/python tests/benchmarks/bench_scale.py --gb 2 --pairs 50000
"""

from __future__ import annotations

import argparse
import inspect
import json
import mmap
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path and "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(REPO))

BOXES, DIM = 36, 2048
BATCH = 256
WORDS = "what color is the man woman dog cat red blue green small large holding riding table".split()  # noqa: SIM905


def ram_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def img_id(i: int) -> str:
    return f"COCO_train2014_{i:012d}"


def write_store(path: Path, count: int) -> float:
    """`count` records of 36 x 2048 float16 regions; returns the seconds taken. Eight random records are
    encoded once; each record written is one of them under its own id, one value per 4 KB of its features
    changed (no two pages alike), with its checksum recomputed: writing is disk-bound."""
    from storage import FeatureWriter, RegionFeatures, codec

    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 300, size=(BOXES, 2))
    boxes = np.concatenate([xy, xy + 100], 1).astype(np.float32)
    objects, attrs = rng.integers(1600, size=BOXES), rng.integers(400, size=BOXES)
    conf = rng.random(BOXES, dtype=np.float32)
    templates = [
        codec.encode(
            RegionFeatures(img_id(0), 480, 640, boxes, rng.standard_normal((BOXES, DIM), dtype=np.float32),
                           objects, conf, attrs, conf)
        )
        for _ in range(8)
    ]  # fmt: skip
    id_at, id_len = codec.HEADER.size, len(img_id(0))
    features_end = len(templates[0])
    start = time.perf_counter()
    with FeatureWriter(path, feature_dim=DIM, max_boxes=BOXES, dtype="float16") as w:
        for i in range(count):
            value = bytearray(templates[i % 8])
            value[id_at : id_at + id_len] = img_id(i).encode()
            # one float16 per 4 KB, inside the features (the last 36 x 2048 x 2 bytes), set from i
            marks = np.ndarray((36,), "<u2", value, features_end - BOXES * DIM * 2, (4096,))
            marks[:] = (i + np.arange(36)) % 15000
            struct.pack_into("<I", value, codec.CRC_OFFSET, codec.checksum(value))
            w.put_encoded(img_id(i), value)
    return time.perf_counter() - start


def disk_rate(data: Path, threads: int, seconds: float, record_bytes: int) -> float:
    """Records/s of O_DIRECT reads of `record_bytes` (rounded up to whole pages) at random page-aligned
    offsets of `data`, by `threads` threads, each reading one at a time."""
    size = os.path.getsize(data)
    span = -(-record_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    pages = (size - span) // mmap.PAGESIZE
    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def run(k: int) -> None:
        fd = os.open(data, os.O_RDONLY | os.O_DIRECT)
        buf = mmap.mmap(-1, span)  # page-aligned, as O_DIRECT requires
        rng = np.random.default_rng(k)
        try:
            while time.perf_counter() < stop:
                for page in rng.integers(0, pages, 64):
                    os.preadv(fd, [buf], int(page) * mmap.PAGESIZE)
                counts[k] += 64
        finally:
            os.close(fd)

    start = time.perf_counter()
    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def drop_caches() -> str | None:
    """Empty the page cache; None, or why it cannot be done here."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        return f"page cache not dropped ({exc.strerror}: needs root on Linux)"
    return None


def make_questions(work: Path, count: int) -> dict:
    """One question per image, and a vocabulary for them."""
    from pipelines.data.text import build_vocab

    rng = np.random.default_rng(0)
    rows = [
        {
            "question_id": i,
            "img_id": img_id(i),
            "sent": " ".join(rng.choice(WORDS, size=6)) + " ?",
            "label": {str(rng.choice(WORDS[4:10])): 1.0},
        }
        for i in range(count)
    ]
    (work / "vqa.json").write_text(json.dumps(rows))
    build_vocab([work / "vqa.json"], work / "vocab.txt", 100)
    return {"vqa": str(work / "vqa.json"), "vocab": str(work / "vocab.txt")}


def measure_loader(spec: dict) -> dict:
    """Records/s delivered by `spec["workers"]` loader processes for `spec["batches"]` batches of the
    trainer's VQA input (runs in its own process: see `loader_rate`). With `repeat`, the batches are read
    once untimed first (warm)."""
    import torch

    from pipelines.engine.trainer import BatchDataset
    from pipelines.tasks import finetune
    from pipelines.tasks.finetune import FinetuneConfig
    from pipelines.tasks.qa import VQATask

    cfg = FinetuneConfig(
        task="vqa", features=[spec["features"]], train_files=[spec["vqa"]], vocab=spec["vocab"]
    )
    # the set-up check of every record the questions use (pipelines.data.bad_records) reads the whole
    # store before training starts: done once per run, it is left out of every measurement here
    finetune.drop_bad = lambda examples, *args: list(examples)
    task = VQATask(cfg)
    ds = task.train_dataset()
    order = np.random.default_rng(spec["seed"]).permutation(len(ds))[: spec["batches"] * BATCH]
    data = BatchDataset(ds, task.collate, order, BATCH, (0, 0, 0))

    def run(timed: bool) -> float:
        loader = torch.utils.data.DataLoader(
            data,
            batch_size=None,
            sampler=list(range(len(data))),
            num_workers=spec["workers"],
            persistent_workers=False,
            prefetch_factor=4,
        )
        it = iter(loader)
        next(it)
        start = time.perf_counter()
        count = sum(1 for _ in it)
        return count * BATCH / (time.perf_counter() - start) if timed else 0.0

    if spec["repeat"]:
        run(False)
    elif spec["cold"]:
        # after the dataset is built (it reads no regions), so the store's pages are all cold
        spec["note"] = drop_caches()
    return {"rps": run(True), "note": spec.get("note")}


def check_time(store: Path, count: int, memo: Path) -> dict:
    """Seconds the trainer's start-up check of every record (storage.checks) takes on the cold store, and
    again on the unchanged store (answered from what the first one kept in `memo`)."""
    from storage import FeatureReader
    from storage.checks import check_records

    out = {}
    for name in ("check_s", "check_again_s"):
        note = drop_caches()
        start = time.perf_counter()
        reader = FeatureReader(store)
        bad = check_records(reader, (img_id(i) for i in range(count)), skip=True, cache=memo)
        out[name] = round(time.perf_counter() - start, 1)
        reader.close()
        if bad:
            raise SystemExit(f"the start-up check found {len(bad)} bad records in {store}")
    out["check_rps"] = round(count / out["check_s"]) if out["check_s"] else None
    out["check_note"] = note
    return out


def loader_rate(spec: dict, tree: Path = REPO) -> dict:
    """`measure_loader(spec)` in a fresh process importing the package from `tree`."""
    code = "import json, sys, bench_scale as b; print(json.dumps(b.measure_loader(json.loads(sys.argv[1]))))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(tree)])}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise SystemExit(f"measuring {spec['workers']} loader processes failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def corpus_figures(pairs: int, work: Path) -> dict:
    """scale_corpus.measure_corpus's figures, or nulls and why."""
    keys = ("pairs", "first_batch_s", "first_batch_cached_s", "driver_rss_gb", "worker_growth_gb")
    keys += ("pairs_sps", "small_sps")
    try:
        sys.path.insert(0, str(Path(__file__).parent))
        from scale_corpus import measure_corpus
    except ImportError as exc:
        return {**dict.fromkeys(keys), "pairs": pairs, "corpus_note": f"corpus not measured ({exc})"}
    offered = {"pairs": pairs, "workdir": work, "work": work}
    wanted = inspect.signature(measure_corpus).parameters
    return measure_corpus(**{k: v for k, v in offered.items() if k in wanted})


def device() -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        "cpu",
    )  # fmt: skip
    return f"{cpu} x {os.cpu_count()}, {ram_bytes() / 2**30:.0f} GiB RAM"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, help="store size in GiB (default 1.2 x RAM)")
    parser.add_argument("--pairs", type=int, default=9_180_000, help="corpus pairs (default 9,180,000)")
    parser.add_argument("--workdir", help="where to write: the disk measured (default: the system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the store and corpus afterwards")
    parser.add_argument("--store", help="measure this store (one --keep left) instead of writing one")
    parser.add_argument("--batches", type=int, default=60, help="timed batches of 256 per cold measurement")
    parser.add_argument("--disk-seconds", type=float, default=5.0, help="seconds per disk measurement")
    parser.add_argument(
        "--compare",
        help="another checkout (e.g. an older commit's) whose loader is also measured, cold and warm",
    )
    args = parser.parse_args()

    ram = ram_bytes()
    gb = args.gb if args.gb is not None else 1.2 * ram / 2**30
    # a record's value: the 32-byte header, its id, 36 x (8 + 8 + 16 + 4 + 4) bytes of boxes and labels
    # and 36 x 2048 x 2 of features, on whole pages after LMDB's 16-byte overflow page header
    value = 32 + 32 + BOXES * 40 + BOXES * DIM * 2
    per_record = -(-(value + 16) // mmap.PAGESIZE) * mmap.PAGESIZE
    count = max(int(gb * 2**30 // per_record), 4 * BATCH)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_scale_", dir=args.workdir))
    try:
        if args.store:
            from storage import FeatureReader

            store = Path(args.store)
            count = len(FeatureReader(store))
        else:
            store = work / "feats.lmdb"
            print(f"writing {count} records ({count * per_record / 2**30:.1f} GiB) to {store}", flush=True)
            write_s = write_store(store, count)
            print(f"written in {write_s:.0f} s", flush=True)
        store_bytes = os.path.getsize(store / "data.mdb")
        disk = {k: disk_rate(store / "data.mdb", k, args.disk_seconds, value) for k in (1, 4)}
        spec = {"features": str(store), **make_questions(work, count), "batches": args.batches}
        # the batches measured must fit the store: at most half of it per measurement
        spec["batches"] = max(2, min(args.batches, count // (2 * BATCH)))
        cold, notes = {}, set()
        for k, workers in enumerate((1, 2, 4)):
            got = loader_rate({**spec, "workers": workers, "seed": k, "cold": True, "repeat": False})
            cold[str(workers)] = got["rps"]
            notes.add(got["note"])
            print(f"cold, {workers} loader processes: {got['rps']:,.0f} records/s", flush=True)
        check = check_time(store, count, work / "record-checks")
        print(f"start-up check of {count} records: {check['check_s']} s cold, {check['check_again_s']} s "
              "again", flush=True)  # fmt: skip
        warm_batches = max(2, min(spec["batches"], int(0.25 * ram // (BATCH * per_record))))
        warm = loader_rate({**spec, "batches": warm_batches, "workers": 1, "seed": 9, "cold": False,
                            "repeat": True})["rps"]  # fmt: skip
        before = {}
        if args.compare:
            tree = Path(args.compare)
            got = loader_rate({**spec, "workers": 1, "seed": 5, "cold": True, "repeat": False}, tree)
            before["cold_rps_1"] = round(got["rps"])
            before["warm_rps"] = round(loader_rate({**spec, "batches": warm_batches, "workers": 1, "seed": 9,
                                                    "cold": False, "repeat": True}, tree)["rps"])  # fmt: skip
            print(f"{args.compare}: cold, 1 loader process {before['cold_rps_1']:,} records/s, warm "
                  f"{before['warm_rps']:,}", flush=True)  # fmt: skip
        corpus = corpus_figures(args.pairs, work / "corpus")  # its own folder: it removes what it wrote
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "name": "bench_scale",
        "device": device(),
        "ram_gb": round(ram / 2**30, 1),
        "store_gb": round(store_bytes / 2**30, 2),
        "records": count,
        "disk_rps_1": round(disk[1]),
        "disk_rps_4": round(disk[4]),
        "cold_rps": {k: round(v) for k, v in cold.items()},
        "warm_rps": round(warm),
        **{k: check[k] for k in ("check_s", "check_rps", "check_again_s")},
        **{k: corpus[k] for k in ("pairs", "first_batch_s", "first_batch_cached_s", "driver_rss_gb")},
        **{k: corpus[k] for k in ("worker_growth_gb", "pairs_sps", "small_sps")},
        "ratio": round(cold["1"] / (0.5 * disk[1]), 3),
        "ratio_4": round(cold["4"] / (0.8 * disk[4]), 3),
        "cache": next((n for n in notes if n), "dropped before each cold measurement"),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
    }
    if before:
        result["compare"] = {"tree": args.compare, **before}
    if corpus.get("corpus_note"):
        result["corpus_note"] = corpus["corpus_note"]
    print()
    print(f"store {result['store_gb']} GiB ({count} records) on a machine with {result['ram_gb']} GiB RAM")
    print(f"{'case':<44}{'records/s':>12}{'vs disk':>10}")
    print(f"{'disk, O_DIRECT 148 KB random, 1 thread':<44}{disk[1]:>12,.0f}{'':>10}")
    print(f"{'disk, O_DIRECT 148 KB random, 4 threads':<44}{disk[4]:>12,.0f}{'':>10}")
    for workers, rps in cold.items():
        ref = disk[1] if workers == "1" else disk[4]
        print(f"{f'cold, {workers} loader processes':<44}{rps:>12,.0f}{rps / ref:>10.2f}")
    print(f"{'warm, 1 loader process':<44}{warm:>12,.0f}")
    print(f"{'start-up check of every record, cold':<44}{check['check_rps']:>12,}{check['check_s']:>9} s")
    print(f"{'start-up check again, store unchanged':<44}{'':>12}{check['check_again_s']:>9} s")
    for key in ("pairs", "first_batch_s", "first_batch_cached_s", "driver_rss_gb", "worker_growth_gb"):
        print(f"{key:<44}{corpus[key]!s:>12}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
