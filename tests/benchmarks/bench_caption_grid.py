"""Show, Attend and Tell on a 14x14 grid store vs the same captioner on a region store, one run.

    .venv/bin/python tests/benchmarks/bench_caption_grid.py                 # 24 min on 2 cores at load 15
    .venv/bin/python tests/benchmarks/bench_caption_grid.py --detector DIR  # reuse a trained c4-small

(Detector training is most of the default run: 834 s of it on that loaded machine; `--detector` with
`--workdir`'s `detector/best` from an earlier run, or fewer `--images`/`--steps`, cut it.)

The demo's generated scenes (`pipelines/apps/demo/synthetic.py`: coloured shapes in a 2x2 layout, with
captions) and its small detector (`xmodal detector train --preset c4-small` on the scenes' boxes), then
with the same weights `xmodal extract` twice: regions (the threshold rule, 10 per image, as the demo)
and `--features grid --grid 14x14`. The same captioner (`--arch`, same seed, steps, sizes and learning
rate) is trained on each store with `xmodal finetune caption`, its best checkpoint captions the held-out
scenes with `xmodal evaluate caption`, and both are scored with CIDEr-D on the same tokens, beside the
most frequent training caption given to every test image. `ratio` = grid CIDEr-D / region CIDEr-D
(>= 0.9: within the issue's 10 %). Every stage is the command a user runs, in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipelines.apps.demo.synthetic import SyntheticConfig, generate  # noqa: E402
from pipelines.cli import main as xmodal  # noqa: E402
from pipelines.data.captions import load_caption_examples  # noqa: E402
from pipelines.scoring.captions import evaluate_captions  # noqa: E402
from storage import FeatureReader  # noqa: E402


def run(name: str, argv: list[str], seconds: dict[str, float]) -> None:
    start = time.perf_counter()
    code = xmodal(argv)
    seconds[name] = round(time.perf_counter() - start, 1)
    if code:
        raise SystemExit(f"stage {name!r} failed with exit status {code}: xmodal {' '.join(argv)}")


def cider(refs: dict[str, list[str]], captions: dict[str, str]) -> float:
    return round(100 * evaluate_captions(refs, captions, pretokenized=True, java=False).metrics["CIDEr"], 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=200, help="generated scenes (70/15/15 split)")
    parser.add_argument("--detector", help="a trained c4-small detector directory (skips its training)")
    parser.add_argument("--detector-steps", type=int, default=400)
    parser.add_argument("--arch", default="sat-soft", choices=("sat-soft", "sat-hard", "updown"))
    parser.add_argument("--steps", type=int, default=300, help="captioner training steps on each store")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: tiny models on a busy box)")
    parser.add_argument("--workdir", help="keep everything here (default: a temporary folder)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench_caption_grid_")
    root = Path(args.workdir or tmp.name).resolve()
    root.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    data = generate(root / "data", SyntheticConfig(num_images=args.images, seed=args.seed, max_shapes=4))
    detector = args.detector
    if detector is None:
        steps = args.detector_steps
        run(
            "detector-train",
            ["detector", "train", "--images", str(data.images_dir),
             "--annotations", str(data.detection["train"]), "--valid", str(data.detection["valid"]),
             "--out", str(root / "detector"), "--preset", "c4-small",
             "--seed", str(args.seed), "--max-steps", str(steps), "--lr", "2e-3",
             "--eval-every", str(max(steps // 2, 1)), f"train.lr_steps=[{steps * 4 // 5},{steps * 17 // 18}]",
             f"train.log_every={max(steps // 10, 1)}"],
            seconds,
        )  # fmt: skip
        detector = str(root / "detector" / "best")

    kinds = {
        "regions": ["--selection", "threshold", "--min-boxes", "10", "--max-boxes", "10"],
        "grid 14x14": ["--features", "grid", "--grid", "14x14"],
    }
    split = str(data.captions)
    test = load_caption_examples(f"{split}:test")
    refs = {e.image_id: [" ".join(c) for c in e.label] for e in test}
    results: dict[str, dict] = {}
    for kind, options in kinds.items():
        tag = kind.split()[0]
        store = root / f"{tag}.lmdb"
        extract = ["extract", str(data.images_dir), "--out", str(store), "--weights", detector, *options,
                   "--batch-size", "8", "--workers", "1", "--no-progress"]  # fmt: skip
        run(f"extract {tag}", extract, seconds)
        run(
            f"train {tag}",
            ["finetune", "caption", "--arch", args.arch, "--features", str(store),
             "--train", f"{split}:train", "--valid", f"{split}:val", "--out", str(root / f"caption-{tag}"),
             "--seed", str(args.seed), "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
             "--lr", str(args.lr), "task.preset=tiny", "task.vocab_min_count=1", "task.max_length=20",
             "task.model.hidden_size=256", "task.model.embed_size=256", "task.model.attention_size=128",
             "train.loader_workers=0", "train.clip_norm=1.0", f"train.log_every={max(args.steps // 10, 1)}",
             f"train.eval_every={max(args.steps // 6, 1)}"],
            seconds,
        )  # fmt: skip
        out = root / f"captions-{tag}.json"
        evaluate = ["evaluate", "caption", "--checkpoint", str(root / f"caption-{tag}" / "best"),
                    "--features", str(store), "--split", f"{split}:test", "--out", str(out)]  # fmt: skip
        run(f"evaluate {tag}", evaluate, seconds)
        reader = FeatureReader(store)
        try:
            cells = sorted({reader[i].num_boxes for i in list(reader.keys())[:20]})
        finally:
            reader.close()
        metrics = json.loads(out.with_suffix(".metrics.json").read_text())
        results[kind] = {
            "records_per_image": cells[0] if len(cells) == 1 else f"{cells[0]}-{cells[-1]}",
            "extract_s": seconds[f"extract {tag}"],
            "train_s": seconds[f"train {tag}"],
            "cider_d": cider(refs, {r["image_id"]: r["caption"] for r in json.loads(out.read_text())}),
            "bleu4": round(metrics["Bleu_4"], 2),  # evaluate writes it in percent
        }
    train = load_caption_examples(f"{split}:train")
    constant = Counter(" ".join(c) for e in train for c in e.label).most_common(1)[0][0]
    baseline = cider(refs, {k: constant for k in refs})

    print(
        f"{args.arch} on {len(test)} held-out scenes ({args.images} generated), {args.steps} steps per store"
    )
    print(f"{'store':<14}{'records/img':>12}{'extract s':>11}{'train s':>9}{'BLEU-4':>8}{'CIDEr-D':>9}")
    for kind, r in results.items():
        print(f"{kind:<14}{r['records_per_image']!s:>12}{r['extract_s']:>11.1f}{r['train_s']:>9.1f}"
              f"{r['bleu4']:>8.2f}{r['cider_d']:>9.2f}")  # fmt: skip
    print(f"{'constant':<14}{'':>12}{'':>11}{'':>9}{'':>8}{baseline:>9.2f}   ({constant!r} for every image)")
    grid, regions = results["grid 14x14"], results["regions"]
    print(
        json.dumps(
            {
                "name": "caption_grid_vs_regions",
                "device": f"cpu x{torch.get_num_threads()}",
                "arch": args.arch,
                "images": args.images,
                "test_images": len(test),
                "steps": args.steps,
                "detector_trained": args.detector is None,
                "grid_cider_d": grid["cider_d"],
                "region_cider_d": regions["cider_d"],
                "baseline_cider_d": baseline,
                "grid_bleu4": grid["bleu4"],
                "region_bleu4": regions["bleu4"],
                "grid_extract_s": grid["extract_s"],
                "region_extract_s": regions["extract_s"],
                "stage_s": seconds,
                "ratio": round(grid["cider_d"] / regions["cider_d"], 3) if regions["cider_d"] else None,
                "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            }
        )
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
