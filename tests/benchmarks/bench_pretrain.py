"""Pre-training throughput: the data loader alone vs the training step, and the whole loop (tiny, base).

The loader (LMDB read, tokenisation, masking, collation, in the trainer's own batch dataset) must deliver
at least 3x the samples/s of a training step so it never limits training; `ratio` = loader / step at
the base preset. Data: a generated store of 36 x 2048 fp16 regions and 5 sentences per image.
Prints a table and one JSON line.

    .venv/bin/python tests/benchmarks/bench_pretrain.py            # 512 images, base batch 8
    .venv/bin/python tests/benchmarks/bench_pretrain.py --quick    # 96 images, base batch 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pipelines.data.text import build_vocab  # noqa: E402
from pipelines.engine import config_io  # noqa: E402
from pipelines.engine.launch import fit  # noqa: E402
from pipelines.engine.run_log import read_metrics  # noqa: E402
from pipelines.engine.trainer import BatchDataset, to_device  # noqa: E402
from pipelines.tasks.pretrain import PretrainRun, PretrainTask  # noqa: E402
from storage import FeatureWriter, RegionFeatures  # noqa: E402

BOXES, DIM, SENTENCES = 36, 2048, 5
WORDS = [
    "man",
    "woman",
    "dog",
    "cat",
    "red",
    "blue",
    "green",
    "small",
    "large",
    "holding",
    "riding",
    "next",
    "to",
    "the",
    "a",
    "on",
    "in",
    "with",
    "table",
]


def make_data(work: Path, images: int) -> dict:
    rng = np.random.default_rng(0)
    rows = []
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
                    features=rng.random((BOXES, DIM), dtype=np.float32),
                    objects_id=rng.integers(1600, size=BOXES),
                    objects_conf=rng.random(BOXES, dtype=np.float32),
                    attrs_id=rng.integers(400, size=BOXES),
                    attrs_conf=rng.random(BOXES, dtype=np.float32),
                )
            )
            sents = [" ".join(rng.choice(WORDS, size=int(rng.integers(6, 16)))) for _ in range(SENTENCES)]
            answers = [{str(rng.choice(WORDS[:9])): 1.0} for _ in range(2)]
            rows.append(
                {
                    "img_id": img_id,
                    "sentf": {"mscoco": sents[:3], "vqa": sents[3:]},
                    "labelf": {"vqa": answers},
                }
            )
    (work / "train.json").write_text(json.dumps(rows))
    build_vocab([work / "train.json"], work / "vocab.txt", 1000)
    return {
        "features": [str(work / "feats.lmdb")],
        "train_files": [str(work / "train.json")],
        "vocab": str(work / "vocab.txt"),
    }


def run_config(data: dict, preset: str, batch: int, steps: int, workers: int) -> PretrainRun:
    run = config_io.load(PretrainRun)
    # the real MLM head size: vocab 30522 whatever the small generated vocab holds
    task = {**data, "preset": preset, "model": {"vocab_size": 30522}}
    train = {
        "batch_size": batch,
        "max_steps": steps,
        "loader_workers": workers,
        "log_every": 1,
        "warmup_ratio": 0.0,
    }
    return config_io.merge(run, {"task": task, "train": train})


def loader_rate(task: PretrainTask, batch: int, batches: int, workers: int) -> float:
    ds = task.train_dataset()
    order = np.random.default_rng(0).permutation(len(ds))
    data = BatchDataset(ds, task.collate, order, batch, (0, 0, 0))
    n = min(batches, len(data))
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=None,
        sampler=list(range(n)),
        num_workers=workers,
        prefetch_factor=4 if workers else None,
    )
    it = iter(loader)
    next(it)  # worker start-up is paid once per epoch, not per batch
    start = time.perf_counter()
    count = sum(1 for _ in it)
    return count * batch / (time.perf_counter() - start)


def step_rate(task: PretrainTask, batch: int, steps: int) -> float:
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    ds = task.train_dataset()
    b = to_device(task.collate([ds[i] for i in range(batch)], np.random.default_rng(0)), torch.device("cpu"))
    model.train()
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss, _ = task.loss(model, b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return batch / float(np.median(times[1:]))


def loop_rate(run: PretrainRun, out: Path) -> float:
    fit(PretrainTask(run.task), run.train, out)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "samples_per_s" in r]
    return float(np.median([r["samples_per_s"] for r in rows[1:]]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data and few steps")
    parser.add_argument("--loader-workers", type=int, default=1, help="DataLoader workers (default 1)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    images = 96 if args.quick else 512
    # (batch, steps): a base step on CPU takes seconds per example, so base batches stay small
    sizes = {"tiny": (32, 4 if args.quick else 10), "base": (2 if args.quick else 8, 2 if args.quick else 3)}
    results: dict = {"loader": {}, "step": {}, "loop": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = make_data(work, images)
        for preset, (batch, steps) in sizes.items():
            task = PretrainTask(run_config(data, preset, batch, steps, 0).task)
            results["loader"][preset] = loader_rate(
                task, batch, 40 if args.quick else 120, args.loader_workers
            )
            results["step"][preset] = step_rate(task, batch, steps)
            run = run_config(data, preset, batch, steps + 1, args.loader_workers)
            results["loop"][preset] = loop_rate(run, work / f"run_{preset}")
            shown = {k: round(v[preset], 2) for k, v in results.items()}
            print(f"{preset}: samples/s {shown}", file=sys.stderr, flush=True)
    print(f"{'preset':<8}{'batch':>7}{'loader/s':>12}{'step/s':>12}{'loop/s':>12}{'loader/step':>13}")
    for preset, (batch, _) in sizes.items():
        lo, st, lp = results["loader"][preset], results["step"][preset], results["loop"][preset]
        print(f"{preset:<8}{batch:>7}{lo:>12.1f}{st:>12.1f}{lp:>12.1f}{lo / st:>13.1f}")
    ratio = results["loader"]["base"] / results["step"]["base"]
    line = {
        "name": "pretrain",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "loader_workers": args.loader_workers,
        "images": images,
        "batch": {p: b for p, (b, _) in sizes.items()},
        "loader_samples_per_s": results["loader"],
        "step_samples_per_s": results["step"],
        "loop_samples_per_s": results["loop"],
        "ratio": ratio,
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
