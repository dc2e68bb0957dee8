"""Training input throughput: the batched path (one store read per micro-batch, float16 features,
sentences tokenised once, vectorised masking) vs the per-example path it replaced, in the same run.

Base preset data: a store of N records of 36 x 2048 float16 regions, 5 sentences per image for
pre-training and 2 questions per image for VQA; batches of 256 delivered through ONE DataLoader worker
process into the measuring (training) process, as the trainer builds them (`BatchDataset`). The old path
is the package tree at `--old-ref` (`git archive`), run by the same measuring code in a subprocess; the
new one is this checkout. `ratio` = new / old pre-training samples/s delivered (`vqa_ratio` for VQA);
samples per CPU-second of batch building are printed beside them, and the CPU milliseconds per batch
spent in the worker (building, pickling, handing memory over) and in the training process (receiving):
the larger of the two bounds one worker's rate on idle cores. Prints a table and one JSON line.

    .venv/bin/python tests/benchmarks/bench_input.py             # N = 5000, 20 batches per side
    .venv/bin/python tests/benchmarks/bench_input.py --quick     # N = 600, 6 batches per side
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
# the tree measured: this checkout, or an old one when run as the measuring subprocess
sys.path.insert(0, os.environ.get("XMODAL_BENCH_TREE", str(REPO)))

BOXES, DIM = 36, 2048
OLD_REF = "9ba3156"  # the last commit with the per-example input path
WORDS = "man woman dog cat red blue green small large holding riding next to the a on in with table".split()  # noqa: SIM905


def make_data(work: Path, images: int) -> dict:
    """The store, a pre-training JSON (5 sentences per image) and a VQA JSON (2 questions per image)."""
    from pipelines.data.text import build_vocab
    from storage import FeatureWriter, RegionFeatures

    rng = np.random.default_rng(0)
    rows, questions = [], []
    feats = rng.random((64, BOXES, DIM), dtype=np.float32).astype(np.float16)  # reused: writing is slow
    with FeatureWriter(work / "feats.lmdb", feature_dim=DIM, max_boxes=BOXES, dtype="float16") as w:
        for i in range(images):
            img_id = f"COCO_train2014_{i:012d}"
            xy = rng.uniform(0, 300, size=(BOXES, 2))
            w.put(
                RegionFeatures(
                    img_id=img_id,
                    img_h=480,
                    img_w=640,
                    boxes=np.concatenate([xy, xy + 100], 1).astype(np.float32),
                    features=feats[i % 64],
                    objects_id=rng.integers(1600, size=BOXES),
                    objects_conf=rng.random(BOXES, dtype=np.float32),
                    attrs_id=rng.integers(400, size=BOXES),
                    attrs_conf=rng.random(BOXES, dtype=np.float32),
                )
            )
            sents = [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 16)))) for _ in range(5)]
            answers = [{str(rng.choice(WORDS[:9])): 1.0} for _ in range(2)]
            rows.append(
                {
                    "img_id": img_id,
                    "sentf": {"mscoco": sents[:3], "vqa": sents[3:]},
                    "labelf": {"vqa": answers},
                }
            )
            for q in range(2):
                questions.append(
                    {"question_id": 2 * i + q, "img_id": img_id, "sent": sents[3 + q], "label": answers[q]}
                )
    (work / "pretrain.json").write_text(json.dumps(rows))
    (work / "vqa.json").write_text(json.dumps(questions))
    build_vocab([work / "pretrain.json"], work / "vocab.txt", 1000)
    return {"features": str(work / "feats.lmdb"), "pretrain": str(work / "pretrain.json"),
            "vqa": str(work / "vqa.json"), "vocab": str(work / "vocab.txt")}  # fmt: skip


def measure(data: dict, task_name: str, batch: int, batches: int, workers: int) -> dict:
    """`delivered`: samples/s of the trainer's micro-batches of `task_name` through `workers` DataLoader
    workers into this process, after the first batch (worker start-up is paid once per epoch); `cpu`:
    samples per CPU-second of building the same batches in this process (what one loader process
    delivers with a core to itself, whatever else loads the machine); `worker_ms` and `main_ms`: CPU
    milliseconds per delivered batch spent in the loader workers (building, pickling, handing memory
    over) and in this process (receiving), whose larger bounds the rate on idle cores."""
    import torch

    from pipelines.engine.trainer import BatchDataset

    if task_name == "pretrain":
        from pipelines.tasks.pretrain import PretrainConfig, PretrainTask

        cfg = PretrainConfig(features=[data["features"]], train_files=[data["pretrain"]], vocab=data["vocab"])
        task = PretrainTask(cfg)
    else:
        from pipelines.tasks.finetune import FinetuneConfig
        from pipelines.tasks.qa import VQATask

        cfg = FinetuneConfig(
            task="vqa", features=[data["features"]], train_files=[data["vqa"]], vocab=data["vocab"]
        )
        task = VQATask(cfg)
    ds = task.train_dataset()
    order = np.random.default_rng(0).permutation(len(ds))
    loader_data = BatchDataset(ds, task.collate, order, batch, (0, 0, 0))
    n = min(batches + 2, len(loader_data))  # the first and the last untimed: workers exit after the last
    loader = torch.utils.data.DataLoader(
        loader_data,
        batch_size=None,
        sampler=list(range(n)),
        num_workers=workers,
        prefetch_factor=4 if workers else None,
    )
    it = iter(loader)
    next(it)
    pids = [w.pid for w in getattr(it, "_workers", [])]
    worker_cpu, main_cpu = _cpu_seconds(pids), time.process_time()
    start = time.perf_counter()
    count = n - 2
    for _ in range(count):
        next(it)
    delivered = count * batch / (time.perf_counter() - start)
    worker_cpu, main_cpu = _cpu_seconds(pids) - worker_cpu, time.process_time() - main_cpu
    for _ in it:
        pass
    start = time.process_time()
    for g in range(1, n - 1):
        loader_data[g]
    return {
        "delivered": delivered,
        "cpu": (n - 2) * batch / (time.process_time() - start),
        "worker_ms": 1e3 * worker_cpu / count,
        "main_ms": 1e3 * main_cpu / count,
    }


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes `pids` have used (Linux /proc)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def run_side(tree: Path, data: dict, args) -> dict:
    """Both tasks' rates measured by this script in a subprocess importing the package from `tree`."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import bench_input as b; "
        "d = json.loads(sys.argv[2]); a = json.loads(sys.argv[3]); "
        "rates = {t: b.measure(d, t, a['batch'], a['batches'], a['workers']) for t in ('pretrain', 'vqa')}; "
        "print(json.dumps(rates))"
    )
    env = {**os.environ, "XMODAL_BENCH_TREE": str(tree), "PYTHONWARNINGS": "ignore"}
    settings = {"batch": args.batch, "batches": args.batches, "workers": args.loader_workers}
    out = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent), json.dumps(data), json.dumps(settings)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise SystemExit(f"measuring {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def old_tree(ref: str, into: Path) -> Path:
    """The package directories of `ref`, extracted under `into`."""
    archive = into / "old.tar"
    with archive.open("wb") as fh:
        subprocess.run(
            ["git", "-C", str(REPO), "archive", ref, "storage", "pipelines", "model"], stdout=fh, check=True
        )
    with tarfile.open(archive) as tar:
        tar.extractall(into / "old", filter="data")
    return into / "old"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 records, 6 batches per side")
    parser.add_argument("--records", type=int, help="store records (default 5000; --quick 600)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--batches", type=int, help="timed batches per side (default 20; --quick 6)")
    parser.add_argument("--loader-workers", type=int, default=1)
    parser.add_argument("--old-ref", default=OLD_REF, help=f"git ref of the old path (default {OLD_REF})")
    parser.add_argument("--work", help="directory for the generated data (default: a temporary one)")
    parser.add_argument(
        "--new-only", action="store_true", help="this checkout's path alone (no git tree: a lent GPU machine)"
    )
    args = parser.parse_args()
    records = args.records or (600 if args.quick else 5000)
    args.batches = args.batches or (6 if args.quick else 20)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        data = make_data(work, records)
        print(f"data: {records} records in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        rates = {"new": run_side(REPO, data, args)}
        print(f"new: {rates['new']}", file=sys.stderr, flush=True)
        if not args.new_only:
            rates["old"] = run_side(old_tree(args.old_ref, work), data, args)
            print(f"old: {rates['old']}", file=sys.stderr, flush=True)
    load_after = os.getloadavg()[0]
    if args.new_only:
        delivered = {t: round(r["delivered"], 1) for t, r in rates["new"].items()}
        print(f"samples/s delivered, {args.loader_workers} worker(s), batch {args.batch}: {delivered}")
        print(json.dumps({
            "name": "input", "device": "cpu", "cpus": os.cpu_count(), "records": records,
            "batch": args.batch, "batches": args.batches, "loader_workers": args.loader_workers,
            "new_samples_per_s": {t: {k: round(v, 1) for k, v in r.items()} for t, r in rates["new"].items()},
        }))  # fmt: skip
        return 0
    print(f"{'task':<10}{'':<22}{'old':>10}{'new':>10}{'gain':>8}")  # gain > 1: the new path is better
    rows = (
        ("delivered", "samples/s, 1 worker"),
        ("cpu", "samples per CPU-s"),
        ("worker_ms", "worker CPU ms/batch"),
        ("main_ms", "main CPU ms/batch"),
    )
    for t in ("pretrain", "vqa"):
        for kind, label in rows:
            old, new = rates["old"][t][kind], rates["new"][t][kind]
            gain = old / new if kind.endswith("_ms") else new / old
            print(f"{t:<10}{label:<22}{old:>10.1f}{new:>10.1f}{gain:>8.2f}")
    line = {
        "name": "input",
        "device": "cpu",
        "cpus": os.cpu_count(),
        "load_average": [round(load_before, 2), round(load_after, 2)],
        "records": records,
        "batch": args.batch,
        "batches": args.batches,
        "loader_workers": args.loader_workers,
        "old_ref": args.old_ref,
        "old_samples_per_s": {t: {k: round(v, 1) for k, v in r.items()} for t, r in rates["old"].items()},
        "new_samples_per_s": {t: {k: round(v, 1) for k, v in r.items()} for t, r in rates["new"].items()},
        "vqa_ratio": round(rates["new"]["vqa"]["delivered"] / rates["old"]["vqa"]["delivered"], 2),
        "ratio": round(rates["new"]["pretrain"]["delivered"] / rates["old"]["pretrain"]["delivered"], 2),
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
