"""Pre-training corpus at LXMERT's size: time to the first batch (converting, then cached), the training
process's memory, each loader worker's growth and samples/s, against a 50 k-pair corpus in the same run.

A community-format JSON of `--pairs` (image, sentence) pairs over `--images` images is generated in the
work folder (written row by row: ~65 % captions of 8-14 words, ~35 % questions of 5-9 words with 1-4
scored answers), and read through the trainer's real input path: `PretrainTask` (conversion into
memory-mapped columns, tokenisation, answer table, collator), its `train_dataset()` and `collate` in the
trainer's `BatchDataset`, delivered by a torch DataLoader with `--workers` processes as the trainer makes
it. Region features (36 x 2048 float16) come from a small generated store, record `k % records` standing
for image k: the feature read is measured by the store's own benchmarks; its records are validated once
instead of once per image. Each measurement runs in a fresh process (a cold start of the training
process; the page cache stays warm).

Memory: `driver_rss_gb` is the training process's peak RSS over the cached run (VmHWM, an upper
bound: it counts every file page it maps and touched, torch's libraries and the corpus's columns, which
are page cache shared with the workers); `driver_anon_gb` its anonymous memory (heap, arrays) and
`driver_pss_gb` its proportional share at the end; `first_run_rss_gb` the peak of the run that
converts. A worker's RSS counts every shared page it touches (the corpus's mapped pages, the training
process's inherited pages), so its growth is measured from /proc/PID/smaps_rollup as
Private_Dirty: what the worker alone holds and cannot give back (its heap, and pages of the training
process it copied on write by touching Python objects), from the first batch to the last.
`worker_uss_growth_gb` (psutil's USS) adds the clean corpus pages only that worker has read so far: page
cache, reclaimable, shared with any other reader.

    .venv/bin/python tests/benchmarks/scale_corpus.py --pairs 200000 --batches 300   # a quick look
    .venv/bin/python tests/benchmarks/scale_corpus.py                                 # 9.18 M pairs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
if str(Path(__file__).parent) not in sys.path:  # imported by another benchmark
    sys.path.append(str(Path(__file__).parent))

from loader_memory import cycled_reader, drive_loader, rollup, status  # noqa: E402

BOXES, DIM = 36, 2048
SMALL_PAIRS = 50_000
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _words(count: int, rng: np.random.Generator) -> list[str]:
    """`count` distinct lowercase pseudo-words of 2-9 letters."""
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words: dict[str, None] = {}
    while len(words) < count:
        n = int(rng.integers(2, 10))
        words.setdefault("".join(rng.choice(letters, n)), None)
    return list(words)


def write_corpus(path: Path, pairs: int, images: int, seed: int = 0) -> list[str]:
    """A community-format pre-training JSON of `pairs` pairs over `images` images, written row by row;
    returns the word list (for the vocabulary)."""
    rng = np.random.default_rng(seed)
    words = np.array(_words(3000, rng), dtype=object)
    answers = words[:400]
    per, extra = divmod(pairs, images)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("[")
        for i in range(images):
            k = per + (i < extra)
            caps = round(0.65 * k)
            lengths = np.concatenate([rng.integers(8, 15, caps), rng.integers(5, 10, k - caps)])
            picks = rng.integers(len(words), size=(k, 14))
            sents = [" ".join(words[picks[j, : lengths[j]]]) for j in range(k)]
            labels = []
            for _ in range(k - caps):
                n = int(rng.integers(1, 5))
                names = answers[rng.integers(len(answers), size=n)]
                labels.append(
                    {str(a): float(s) for a, s in zip(names, (1.0, 0.6, 0.3, 0.3)[:n], strict=True)}
                )
            row = {
                "img_id": f"COCO_train2014_{i:012d}",
                "sentf": {"mscoco": sents[:caps], "vqa": [s + "?" for s in sents[caps:]]},
                "labelf": {"vqa": labels},
            }
            fh.write(("," if i else "") + json.dumps(row))
        fh.write("]")
    return list(words)


def write_vocab(path: Path, words: list[str]) -> None:
    path.write_text("".join(t + "\n" for t in (*SPECIAL, "?", *words)), encoding="utf-8")


def write_store(path: Path, records: int) -> None:
    from storage import FeatureWriter, RegionFeatures

    rng = np.random.default_rng(1)
    with FeatureWriter(path, feature_dim=DIM, max_boxes=BOXES, dtype="float16") as w:
        for k in range(records):
            xy = rng.uniform(0, 300, size=(BOXES, 2))
            w.put(
                RegionFeatures(
                    img_id=f"r{k}",
                    img_h=480,
                    img_w=640,
                    boxes=np.concatenate([xy, xy + 100], 1).astype(np.float32),
                    features=rng.random((BOXES, DIM), dtype=np.float32).astype(np.float16),
                    objects_id=rng.integers(1600, size=BOXES),
                    objects_conf=rng.random(BOXES, dtype=np.float32),
                    attrs_id=rng.integers(400, size=BOXES),
                    attrs_conf=rng.random(BOXES, dtype=np.float32),
                )
            )


def _child(args: dict) -> dict:
    """One cold start of the training process: the task, its dataset, `batches` batches through the
    loader. Runs in its own process."""
    import psutil

    import pipelines.tasks.pretrain as pretrain_task
    from pipelines.data.bad_records import bad_records
    from storage import FeatureReader

    records = args["records"]

    def check_store(features, ids, skip):
        return bad_records(FeatureReader(features.paths), [f"r{k}" for k in range(records)], skip)

    pretrain_task.FeatureReader = cycled_reader(records)
    pretrain_task.bad_records = check_store
    start = time.perf_counter()
    cfg = pretrain_task.PretrainConfig(
        features=[args["store"]],
        train_files=[args["corpus"]],
        vocab=args["vocab"],
        token_cache=args["cache"],
    )
    task = pretrain_task.PretrainTask(cfg)
    dataset = task.train_dataset()
    run = drive_loader(
        dataset, task.collate, args["batch_size"], args["batches"], args["workers"], start, 500
    )
    return {
        "pairs": len(dataset),
        "first_batch_s": run["first_batch_s"],
        "sps": run["sps"],
        # VmHWM: this process's own peak (ru_maxrss would also count the parent's at the fork)
        "peak_rss_gb": status("VmHWM") / 2**30,
        "rss_gb": psutil.Process().memory_info().rss / 2**30,
        "anon_gb": rollup("self", "Anonymous") / 2**30,
        "pss_gb": rollup("self", "Pss") / 2**30,
        "worker_growth_gb": run["worker_growth_gb"],
        "worker_uss_growth_gb": run["worker_uss_growth_gb"],
    }


def _run_child(args: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="true")
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(args)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_corpus(
    pairs: int = 9_180_000,
    images: int = 180_000,
    workdir: Path | None = None,
    batch_size: int = 256,
    batches: int = 10_000,
    num_workers: int = 2,
    small_pairs: int = SMALL_PAIRS,
    small_batches: int | None = None,
    records: int = 256,
    keep: bool = False,
) -> dict:
    """The corpus figures (see the module docstring) for `pairs` pairs over `images` images, generated in
    `workdir` (a temporary folder when None) and removed afterwards unless `keep`; `small_sps` is the
    same pipeline on a `small_pairs` corpus over proportionally fewer images, for `small_batches`
    batches (default: `batches`, at most 2,000)."""
    own = workdir is None
    work = Path(tempfile.mkdtemp(prefix="scale-corpus-")) if own else Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        write_store(work / "feats.lmdb", records)
        common = {"store": str(work / "feats.lmdb"), "records": records, "batch_size": batch_size}
        common["workers"] = num_workers

        def corpus(name: str, n: int, imgs: int) -> dict:
            words = write_corpus(work / f"{name}.json", n, imgs)
            write_vocab(work / "vocab.txt", words)
            return {**common, "corpus": str(work / f"{name}.json"), "vocab": str(work / "vocab.txt")}

        t = time.perf_counter()
        big = corpus("pairs", pairs, images)
        generate_s = time.perf_counter() - t
        big["cache"] = str(work / "cache")
        first = _run_child({**big, "batches": 2})
        cached = _run_child({**big, "batches": batches})
        small_imgs = max(1, round(images * small_pairs / pairs))
        small = corpus("small", small_pairs, small_imgs)
        small["cache"] = str(work / "small-cache")
        small_run = _run_child({**small, "batches": small_batches or min(batches, 2000)})
        return {
            "pairs": cached["pairs"],
            "images": images,
            "json_gb": (work / "pairs.json").stat().st_size / 2**30,
            "generate_s": generate_s,
            "first_batch_s": first["first_batch_s"],
            "first_batch_cached_s": cached["first_batch_s"],
            "first_run_rss_gb": first["peak_rss_gb"],
            "driver_rss_gb": cached["peak_rss_gb"],
            "driver_anon_gb": cached["anon_gb"],
            "driver_pss_gb": cached["pss_gb"],
            "worker_growth_gb": cached["worker_growth_gb"],
            "worker_uss_growth_gb": cached["worker_uss_growth_gb"],
            "batches": batches,
            "pairs_sps": cached["sps"],
            "small_pairs": small_run["pairs"],
            "small_sps": small_run["sps"],
        }
    finally:
        if own or not keep:
            for name in ("pairs.json", "small.json", "vocab.txt", "feats.lmdb", "cache", "small-cache"):
                p = work / name
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        if own:
            shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=9_180_000)
    parser.add_argument("--images", type=int, default=None, help="default: pairs / 51 (LXMERT's ratio)")
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    images = args.images or max(1, round(args.pairs * 180_000 / 9_180_000))
    r = measure_corpus(args.pairs, images, args.workdir, args.batch_size, args.batches, args.workers)
    rows = [
        ("pairs / images", f"{r['pairs']:,} / {images:,} ({r['json_gb']:.2f} GB of JSON)"),
        ("time to first batch, converting", f"{r['first_batch_s']:.1f} s"),
        ("time to first batch, cached", f"{r['first_batch_cached_s']:.1f} s"),
        ("training process peak RSS, converting", f"{r['first_run_rss_gb']:.2f} GB"),
        ("training process peak RSS, cached", f"{r['driver_rss_gb']:.2f} GB"),
        ("  at the end: anonymous / PSS", f"{r['driver_anon_gb']:.2f} / {r['driver_pss_gb']:.2f} GB"),
        (
            f"worker growth over {r['batches']:,} batches (private dirty)",
            f"{r['worker_growth_gb'] * 1024:.0f} MB",
        ),
        ("worker growth (USS, incl. clean corpus pages)", f"{r['worker_uss_growth_gb'] * 1024:.0f} MB"),
        ("samples/s, this corpus", f"{r['pairs_sps']:,.0f}"),
        (f"samples/s, {r['small_pairs']:,} pairs", f"{r['small_sps']:,.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    line = {"name": "scale_corpus", "device": "cpu", "cpus": os.cpu_count(), **r}
    line["ratio"] = r["pairs_sps"] / r["small_sps"] if r["small_sps"] else None
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
