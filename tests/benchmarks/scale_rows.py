"""Fine-tuning rows at VQA/GQA's size: building the VQA task's training set (converting, then cached), the
training process's memory and a loader worker's growth, for this tree against another (`--compare`).

A LXMERT-format VQA JSON of `--questions` questions over `--images` images is generated in the work
folder (questions of 4-10 words, 1-4 scored answers each from 3,000, int question ids, answer and question
types), and read through the real fine-tuning path: `VQATask` (rows, image and bad-record checks, answer
table, tokens), its `train_dataset()` and `collate` in the trainer's `BatchDataset`, delivered by a torch
DataLoader with `--workers` processes. Region features come from a small generated store (36 x 2048
float16), record `k % records` standing for image k, validated once. Each measurement runs in a fresh
process (a cold start; the page cache stays warm): once with no cache (`first`), then again with the cache
the first run left (`cached`: rows, tokens and targets mapped where the tree keeps them).

Memory: `peak_rss_gb` is the training process's peak RSS (ru_maxrss: it counts mapped file pages it
touched too); `anon_gb` its anonymous memory (heap, arrays, Python objects) with the loader running;
`worker_growth_mb` a loader worker's Private_Dirty growth (/proc/PID/smaps_rollup) from its first batch
to its last: what it copied on write by touching the training process's Python objects, plus its heap.

    .venv/bin/python tests/benchmarks/scale_rows.py --questions 300000 --compare /work/main
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
TREE_VARIABLE = "SCALE_ROWS_TREE"  # the checkout a measuring process imports the package from
sys.path.insert(0, os.environ.get(TREE_VARIABLE, str(REPO)))

from loader_memory import cycled_reader, drive_loader  # noqa: E402

from tests.benchmarks.scale_corpus import _words, write_store  # noqa: E402

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def write_questions(path: Path, questions: int, images: int, seed: int = 0) -> list[str]:
    """A LXMERT-format VQA JSON of `questions` questions over `images` images; returns the words."""
    rng = np.random.default_rng(seed)
    words = np.array(_words(3000, rng), dtype=object)
    answers = words[:3000]
    kinds = ("yes/no", "number", "other")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("[")
        for start in range(0, questions, 10_000):
            n = min(10_000, questions - start)
            lengths = rng.integers(4, 11, n)
            picks = rng.integers(len(words), size=(n, 10))
            counts = rng.integers(1, 5, n)
            names = rng.integers(len(answers), size=(n, 4))
            imgs = rng.integers(images, size=n)
            rows = []
            for j in range(n):
                label = {str(answers[names[j, k]]): (1.0, 0.6, 0.3, 0.3)[k] for k in range(counts[j])}
                rows.append(
                    {
                        "answer_type": kinds[j % 3],
                        "img_id": f"COCO_train2014_{imgs[j]:012d}",
                        "label": label,
                        "question_id": start + j,
                        "question_type": "what is the",
                        "sent": " ".join(words[picks[j, : lengths[j]]]) + "?",
                    }
                )
            fh.write(("," if start else "") + ",".join(json.dumps(r) for r in rows))
        fh.write("]")
    return list(words)


def _child(args: dict) -> dict:
    """One cold start of the training process: the task, its training set, `batches` batches through the
    loader. Runs in its own process."""
    import resource

    import pipelines.data.bad_records as bad_mod
    import pipelines.tasks.finetune as finetune_mod
    from pipelines.tasks.finetune import FinetuneConfig
    from pipelines.tasks.qa import VQATask
    from storage import FeatureReader

    records = args["records"]
    original = bad_mod.bad_records

    def check_store(features, ids, skip):
        list(ids)  # what the tree gathers is its own cost
        return original(FeatureReader(features.paths), [f"r{k}" for k in range(records)], skip)

    finetune_mod.FeatureReader = cycled_reader(records)
    bad_mod.bad_records = check_store
    if hasattr(finetune_mod, "bad_records"):
        finetune_mod.bad_records = check_store
    start = time.perf_counter()
    cfg = FinetuneConfig(
        task="vqa",
        features=[args["store"]],
        train_files=[args["questions"]],
        vocab=args["vocab"],
        preset="tiny",
        model={"visual_feat_dim": 2048},
    )
    try:
        task = VQATask(cfg, cache_dir=Path(args["cache"]))
    except TypeError:  # a tree whose task takes its cache folder after it is built
        task = VQATask(cfg)
        task.token_cache = Path(args["cache"])
    dataset = task.train_dataset()
    build = time.perf_counter() - start
    run = drive_loader(
        dataset, task.collate, args["batch_size"], args["batches"], args["workers"], start, 100
    )
    import pipelines

    return {
        "package": str(Path(pipelines.__file__).parents[1]),  # the tree measured
        "questions": len(dataset),
        "build_s": build,
        "first_batch_s": run["first_batch_s"],
        "sps": run["sps"],
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "anon_gb": run["peak_anon_gb"],
        "worker_growth_mb": run["worker_growth_gb"] * 1024,
    }


def _run_child(tree: Path, args: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), TOKENIZERS_PARALLELISM="true", **{TREE_VARIABLE: str(tree)})
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tree,
    )
    if done.returncode != 0:
        raise RuntimeError(f"measuring process ({tree}) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(tree: Path, common: dict, cache: Path) -> dict:
    """`first` (no cache) and `cached` runs of `tree`."""
    shutil.rmtree(cache, ignore_errors=True)
    first = _run_child(tree, {**common, "cache": str(cache), "batches": 2})
    cached = _run_child(tree, {**common, "cache": str(cache)})
    shutil.rmtree(cache, ignore_errors=True)
    return {"first": first, "cached": cached}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=1_000_000)
    parser.add_argument("--images", type=int, default=120_000)
    parser.add_argument("--batches", type=int, default=1_000)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--compare", type=Path, default=None, help="another checkout (main) to measure")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(json.loads(args.child))))
        return 0
    own = args.workdir is None
    work = Path(tempfile.mkdtemp(prefix="scale-rows-")) if own else args.workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        write_store(work / "feats.lmdb", args.records)
        t = time.perf_counter()
        words = write_questions(work / "questions.json", args.questions, args.images)
        generate_s = time.perf_counter() - t
        (work / "vocab.txt").write_text("".join(w + "\n" for w in (*SPECIAL, "?", *words)))
        common = {
            "store": str(work / "feats.lmdb"),
            "records": args.records,
            "questions": str(work / "questions.json"),
            "vocab": str(work / "vocab.txt"),
            "batch_size": args.batch_size,
            "batches": args.batches,
            "workers": args.workers,
        }
        ours = measure(REPO, common, work / "cache")
        theirs = measure(args.compare, common, work / "cache") if args.compare else None
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    figures = [
        ("build the training set, no cache (s)", "first", "build_s", "{:.1f}"),
        ("build the training set, cached (s)", "cached", "build_s", "{:.1f}"),
        ("peak RSS, no cache (GB)", "first", "peak_rss_gb", "{:.2f}"),
        ("peak RSS, cached (GB)", "cached", "peak_rss_gb", "{:.2f}"),
        ("anonymous memory while loading, cached (GB)", "cached", "anon_gb", "{:.2f}"),
        (f"worker growth over {args.batches:,} batches (MB)", "cached", "worker_growth_mb", "{:.0f}"),
        ("samples/s", "cached", "sps", "{:,.0f}"),
    ]
    head = ["figure", "this tree"] + (["compare"] if theirs else [])
    print(f"{args.questions:,} questions over {args.images:,} images, JSON written in {generate_s:.0f} s")
    print(" | ".join(head))
    for label, run, key, fmt in figures:
        cells = [label, fmt.format(ours[run][key])] + ([fmt.format(theirs[run][key])] if theirs else [])
        print(" | ".join(cells))
    line = {
        "name": "scale_rows",
        "device": "cpu",
        "cpus": os.cpu_count(),
        "questions": ours["cached"]["questions"],
        "images": args.images,
        "batches": args.batches,
        "ours": ours,
    }
    if theirs:
        line["compare"] = {"tree": str(args.compare), **theirs}
        line["ratio"] = theirs["cached"]["anon_gb"] / ours["cached"]["anon_gb"]
        line["ratio_build_cached"] = theirs["cached"]["build_s"] / ours["cached"]["build_s"]
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
