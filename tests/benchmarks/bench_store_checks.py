"""What the store's safety checks cost: the B-tree walk a reader makes when it opens a store, the walk with
value pages that verify makes, and record validation (`FeatureReader(validate=True)`).

The walk reads branch and leaf pages only, so its cost depends on the number of records, not their size:
the store for it holds N records of 4 x 256 float16 features (each value on its own overflow page, as a
36 x 2048 record's is). Validation is timed on 36 x 2048 float16 records. Prints a table and one JSON line.

    .venv/bin/python tests/benchmarks/bench_store_checks.py             # N = 20000, ~90 MB of temp files
    .venv/bin/python tests/benchmarks/bench_store_checks.py --n 100000  # about 450 MB
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from storage import FeatureReader, FeatureWriter, RegionFeatures  # noqa: E402
from storage.btree import walk_records  # noqa: E402
from storage.validate import RecordLimits, problem  # noqa: E402


def record(i: int, boxes: int, dim: int, rng: np.random.Generator) -> RegionFeatures:
    x = rng.uniform(0, 300, boxes).astype(np.float32)
    y = rng.uniform(0, 200, boxes).astype(np.float32)
    return RegionFeatures(
        img_id=f"COCO_train2014_{i:012d}",
        img_h=480,
        img_w=640,
        boxes=np.stack([x, y, x + 100, y + 100], 1),
        features=rng.random((boxes, dim), dtype=np.float32),
        objects_id=rng.integers(0, 1600, boxes),
        objects_conf=rng.random(boxes, dtype=np.float32),
        attrs_id=rng.integers(0, 400, boxes),
        attrs_conf=rng.random(boxes, dtype=np.float32),
    )


def best_of(fn, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="records in the store the walk is timed on")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    out: dict = {"name": "store_checks", "device": "cpu", "n": args.n}
    with tempfile.TemporaryDirectory() as tmp:
        walk_store = Path(tmp) / "walk.lmdb"
        pool = [record(i, 4, 256, rng) for i in range(64)]
        with FeatureWriter(walk_store, feature_dim=256, max_boxes=4, commit_every=4096) as w:
            for i in range(args.n):
                rec = pool[i % len(pool)]
                rec.img_id = f"COCO_train2014_{i:012d}"
                w.put(rec)
        data = walk_store / "data.mdb"
        out["walk_ms"] = 1e3 * best_of(lambda: walk_records(data, b"records"))
        out["walk_values_ms"] = 1e3 * best_of(lambda: walk_records(data, b"records", values=True))

        def open_first():
            reader = FeatureReader(walk_store)
            reader["COCO_train2014_000000000000"]
            reader.close()

        out["open_first_record_ms"] = 1e3 * best_of(open_first)

        big = Path(tmp) / "big.lmdb"
        recs = [record(i, 36, 2048, rng) for i in range(300)]
        with FeatureWriter(big, feature_dim=2048, max_boxes=36) as w:
            for rec in recs:
                w.put(rec)
        ids = [r.img_id for r in recs]
        limits = RecordLimits(feature_dim=2048, max_boxes=36)
        stored = FeatureReader(big)[ids[0]]
        out["validate_us"] = 1e6 * best_of(lambda: [problem(stored, limits) for _ in range(1000)]) / 1000

        def read_all(reader: FeatureReader) -> None:
            for img_id in ids:  # each record dropped at once, as a DataLoader worker does
                reader[img_id]

        rates = {}
        for validate in (False, True):
            reader = FeatureReader(big, validate=validate)
            read_all(reader)  # map the pages in
            per = [best_of(lambda r=reader: read_all(r), rounds=1) / len(ids) for _ in range(9)]
            rates[validate] = statistics.median(per)
            reader.close()
        out["read_us"] = 1e6 * rates[False]
        out["read_validated_us"] = 1e6 * rates[True]
    rows = [
        (f"reader open -> first record, {args.n} records", f"{out['open_first_record_ms']:.1f} ms"),
        (f"tree walk on open (branch + leaf pages), {args.n} records", f"{out['walk_ms']:.1f} ms"),
        (f"tree walk with value pages (verify), {args.n} records", f"{out['walk_values_ms']:.1f} ms"),
        ("validate one 36 x 2048 float16 record", f"{out['validate_us']:.0f} µs"),
        ("read one 36 x 2048 record", f"{out['read_us']:.0f} µs"),
        ("read one 36 x 2048 record, validate=True", f"{out['read_validated_us']:.0f} µs"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>10}")
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
