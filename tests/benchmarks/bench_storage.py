"""Feature-store benchmark: LMDB FeatureReader vs h5py vs loading the LXMERT TSV whole.

Writes N fp16 36x2048 records three ways, then measures in fresh processes: write rate, warm random
reads, time from open to the first record, and memory private to the process (RssAnon: heap, not the
shared, reclaimable page cache a memory map uses). Prints a table and one JSON line.

    .venv/bin/python tests/benchmarks/bench_storage.py            # N = 5000 (about 4 GB of temp files)
    .venv/bin/python tests/benchmarks/bench_storage.py --quick    # N = 300
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BOXES, DIM = 36, 2048
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from storage import FeatureReader, FeatureWriter, RegionFeatures  # noqa: E402
from storage.tsv import format_line  # noqa: E402


def proc_status(field: str) -> int:
    """A /proc/self/status figure in bytes (RssAnon: private heap; VmHWM: peak resident set)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def records(n: int):
    """n distinct-id records drawn from a small pool of random arrays (content does not affect speed)."""
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal((BOXES, DIM), dtype=np.float32) for _ in range(8)]
    boxes = (rng.random((BOXES, 4), dtype=np.float32) * 500).astype(np.float32)
    for i in range(n):
        yield RegionFeatures(
            img_id=f"COCO_train2014_{i:012d}",
            img_h=480,
            img_w=640,
            boxes=boxes,
            features=pool[i % len(pool)],
            objects_id=np.arange(BOXES),
            objects_conf=np.ones(BOXES, np.float32),
            attrs_id=np.arange(BOXES),
            attrs_conf=np.ones(BOXES, np.float32),
        )


def write_all(work: Path, n: int) -> dict:
    out = {}
    t = time.perf_counter()
    with FeatureWriter(work / "feats.lmdb", feature_dim=DIM, max_boxes=BOXES, dtype="float16") as w:
        for rec in records(n):
            w.put(rec)
    out["lmdb_write_rec_s"] = n / (time.perf_counter() - t)

    import h5py

    t = time.perf_counter()
    with h5py.File(work / "feats.h5", "w") as f:
        ds = f.create_dataset("image_features", (n, BOXES, DIM), "f2")
        for i, rec in enumerate(records(n)):
            ds[i] = rec.features
    out["h5py_write_rec_s"] = n / (time.perf_counter() - t)

    t = time.perf_counter()
    with open(work / "feats.tsv", "w") as f:
        for rec in records(n):
            f.write(format_line(rec))
    out["tsv_write_rec_s"] = n / (time.perf_counter() - t)
    return out


def child(kind: str, path: str, n: int, reads: int) -> dict:
    """Runs in a fresh process. lmdb / h5py / tsv: open -> first record and private memory; race: warm
    random read rates of all readers, interleaved in rounds so machine load hits them alike."""
    rng = np.random.default_rng(1)
    order = [int(i) for i in rng.permutation(n)]
    ids = [f"COCO_train2014_{i:012d}" for i in range(n)]
    if kind == "race":
        return race(Path(path), ids, order, reads, rng)
    anon0 = proc_status("RssAnon")
    if kind == "tsv":
        t = time.perf_counter()
        data = load_obj_tsv(path)
        first = time.perf_counter() - t
        return {
            "first_s": first,
            "anon_growth": proc_status("RssAnon") - anon0,
            "peak_rss": proc_status("VmHWM"),
            "count": len(data),
        }
    if kind == "lmdb":
        keys = [ids[i] for i in order]
        t = time.perf_counter()
        get = FeatureReader(path).__getitem__
        get(keys[0])
    else:
        import h5py

        keys = order
        t = time.perf_counter()
        get = h5py.File(path, "r")["image_features"].__getitem__
        get(keys[0])
    first = time.perf_counter() - t
    for k in keys[: n // 10]:
        get(k)
    anon_tenth = proc_status("RssAnon")
    for k in keys:
        get(k)
    anon_all = proc_status("RssAnon")
    return {
        "first_s": first,
        "anon_growth_tenth_to_all": anon_all - anon_tenth,
        "anon_growth": anon_all - anon0,
        "peak_rss": proc_status("VmHWM"),
    }


def race(work: Path, ids: list[str], order: list[int], reads: int, rng, rounds: int = 10) -> dict:
    """Median records/s over `rounds` alternating rounds of random reads, after a warm-up pass."""
    import h5py

    reader = FeatureReader(work / "feats.lmdb")
    ds = h5py.File(work / "feats.h5", "r")["image_features"]
    for i in order:  # warm: every page in the page cache and mapped
        reader[ids[i]]
        ds[i]
    picks = [int(i) for i in rng.integers(0, len(ids), reads // rounds)]
    lmdb_keys = [ids[i] for i in picks]
    rates: dict[str, list[float]] = {"lmdb": [], "view": [], "h5py": []}
    for _ in range(rounds):
        t = time.perf_counter()
        for k in lmdb_keys:
            reader[k]
        rates["lmdb"].append(len(picks) / (time.perf_counter() - t))
        t = time.perf_counter()
        for i in picks:
            ds[i]
        rates["h5py"].append(len(picks) / (time.perf_counter() - t))
        with reader.view() as v:
            t = time.perf_counter()
            for k in lmdb_keys:
                v[k]
            rates["view"].append(len(picks) / (time.perf_counter() - t))
    return {name: float(np.median(r)) for name, r in rates.items()}


def load_obj_tsv(fname: str) -> list:
    """LXMERT's loader (src/utils.py): every record decoded into one in-memory list."""
    import csv

    csv.field_size_limit(sys.maxsize)
    names = [
        "img_id",
        "img_h",
        "img_w",
        "objects_id",
        "objects_conf",
        "attrs_id",
        "attrs_conf",
        "num_boxes",
        "boxes",
        "features",
    ]
    data = []
    with open(fname) as f:
        for item in csv.DictReader(f, names, delimiter="\t"):
            for key in ("img_h", "img_w", "num_boxes"):
                item[key] = int(item[key])
            n = item["num_boxes"]
            for key, shape, dtype in (
                ("objects_id", (n,), np.int64),
                ("objects_conf", (n,), np.float32),
                ("attrs_id", (n,), np.int64),
                ("attrs_conf", (n,), np.float32),
                ("boxes", (n, 4), np.float32),
                ("features", (n, -1), np.float32),
            ):
                item[key] = np.frombuffer(base64.b64decode(item[key]), dtype=dtype).reshape(shape)
            data.append(item)
    return data


def run_child(kind: str, path: Path, n: int, reads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, str(path), "--n", str(n), "--reads", str(reads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=5000, help="records (default 5000)")
    parser.add_argument("--quick", action="store_true", help="N = 300, for a smoke run")
    parser.add_argument("--reads", type=int, default=20000, help="timed random reads per backend")
    parser.add_argument("--workdir", help="where the temporary files go (default: a temp dir)")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.n, args.reads)))
        return
    n = 300 if args.quick else args.n
    reads = min(args.reads, 3000) if args.quick else args.reads
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        writes = write_all(work, n)
        with FeatureWriter(work / "tiny.lmdb", feature_dim=DIM, max_boxes=BOXES) as w:
            for rec in records(10):
                w.put(rec)
        lm = run_child("lmdb", work / "feats.lmdb", n, 0)
        tiny = run_child("lmdb", work / "tiny.lmdb", 10, 0)
        h5 = run_child("h5py", work / "feats.h5", n, 0)
        tsv = run_child("tsv", work / "feats.tsv", n, 0)
        rates = run_child("race", work, n, reads)
        sizes = {
            name: sum(f.stat().st_size for f in (work / name).rglob("*") if f.is_file())
            if (work / name).is_dir()
            else (work / name).stat().st_size
            for name in ("feats.lmdb", "feats.h5", "feats.tsv")
        }
    mb = 1 / 2**20
    rows = [
        (
            "write records/s",
            writes["lmdb_write_rec_s"],
            writes["h5py_write_rec_s"],
            writes["tsv_write_rec_s"],
        ),
        ("warm random reads/s", rates["lmdb"], rates["h5py"], None),
        ("  copy-free view reads/s", rates["view"], None, None),
        ("open -> first record, ms", lm["first_s"] * 1e3, h5["first_s"] * 1e3, tsv["first_s"] * 1e3),
        ("  same, 10-record store, ms", tiny["first_s"] * 1e3, None, None),
        (
            "private memory growth, N/10 -> N reads, MiB",
            lm["anon_growth_tenth_to_all"] * mb,
            h5["anon_growth_tenth_to_all"] * mb,
            None,
        ),
        (
            "private memory after reading all, MiB",
            lm["anon_growth"] * mb,
            h5["anon_growth"] * mb,
            tsv["anon_growth"] * mb,
        ),
        (
            "peak RSS (LMDB: incl. shared map pages), MiB",
            lm["peak_rss"] * mb,
            h5["peak_rss"] * mb,
            tsv["peak_rss"] * mb,
        ),
        ("size on disk, MiB", sizes["feats.lmdb"] * mb, sizes["feats.h5"] * mb, sizes["feats.tsv"] * mb),
    ]
    print(f"feature store, N={n} records of {BOXES}x{DIM} float16 (TSV: float32, as LXMERT's)")
    print(f"{'':46} {'LMDB':>12} {'h5py':>12} {'TSV whole':>12}")
    for label, *vals in rows:
        print(f"{label:46} " + " ".join(f"{v:12.1f}" if v is not None else f"{'-':>12}" for v in vals))
    result = {
        "name": "storage",
        "device": "cpu",
        "n": n,
        "reads": reads,
        "write_rec_s": round(writes["lmdb_write_rec_s"], 1),
        "read_rec_s": round(rates["lmdb"], 1),
        "view_read_rec_s": round(rates["view"], 1),
        "h5py_read_rec_s": round(rates["h5py"], 1),
        "first_record_ms": round(lm["first_s"] * 1e3, 2),
        "first_record_ms_10_records": round(tiny["first_s"] * 1e3, 2),
        "h5py_first_record_ms": round(h5["first_s"] * 1e3, 2),
        "tsv_first_record_s": round(tsv["first_s"], 2),
        "private_growth_mib": round(lm["anon_growth_tenth_to_all"] * mb, 2),
        "tsv_private_mib": round(tsv["anon_growth"] * mb, 1),
        "tsv_peak_rss_mib": round(tsv["peak_rss"] * mb, 1),
        "ratio": round(rates["lmdb"] / rates["h5py"], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
