"""`xmodal detector`: train and evaluate the Faster R-CNN on your own boxes and attributes, and convert
Visual Genome's annotation files to the COCO-style JSON it trains on."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path

from pipelines.commands.run_options import add_overrides_argument

log = logging.getLogger(__name__)

TRAIN_EPILOG = """\
annotations: COCO detection JSON: images [{id, file_name, width, height}], annotations [{id, image_id,
bbox [x, y, w, h], category_id, iscrowd, attribute_ids [..]}], categories [{id, name}], and an optional
top-level attributes [{id, name}] table. Boxes outside the image are clipped, empty boxes and unknown
categories skipped, and each counted (--strict stops on them instead).
defaults: detectron2's R-C4 recipe (SGD momentum 0.9, weight decay 1e-4, warm-up from 1/1000, x0.1 steps;
vg-r101-c4: lr 0.02, 16 images, 90k steps); c4-small trains in minutes on 2 CPU cores.
precedence: preset defaults < --config YAML (train.* and task.* keys; a run's config.yaml works) < flags
< KEY=VALUE overrides (e.g. train.lr=0.01 task.training.roi_batch_size=256 task.detector.min_size=800).
The run directory holds best/ (by validation AP), last/, checkpoints/, metrics.jsonl, config.yaml; best/
and last/ load with `xmodal extract --weights RUN/best`.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipelines.engine.devices import DEFAULT_DEVICE, DEVICE_HELP

    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    train = sub.add_parser(
        "train",
        help="train or fine-tune the detector",
        description="train or fine-tune the detector on COCO-style boxes with attributes",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_train_arguments(train)
    evaluate = sub.add_parser(
        "evaluate",
        help="COCO box AP and attribute accuracy of trained weights",
        description="COCO box AP (pycocotools) and attribute accuracy on ground-truth boxes; prints a table "
        "and a JSON line",
    )
    evaluate.add_argument("--weights", required=True, help="a detector directory (RUN/best) or checkpoint")
    evaluate.add_argument("--images", required=True, help="folder the annotations' file names are under")
    evaluate.add_argument("--annotations", required=True, help="COCO-style JSON with the held-out boxes")
    evaluate.add_argument("--preset", help="for a checkpoint file: its preset (a directory knows its own)")
    evaluate.add_argument("--strict", action="store_true", help="stop on bad annotations instead of counting")
    evaluate.add_argument("--out", help="also write the metrics JSON here")
    evaluate.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)
    convert = sub.add_parser(
        "convert-vg",
        help="Visual Genome objects/attributes/image_data JSON -> COCO-style training JSON",
        description="convert Visual Genome's own files to the COCO-style JSON `detector train` reads, "
        "names mapped through the bottom-up-attention vocabularies",
    )
    convert.add_argument("--objects", required=True, help="objects.json")
    convert.add_argument("--attributes", required=True, help="attributes.json")
    convert.add_argument("--image-data", required=True, help="image_data.json")
    convert.add_argument("--objects-vocab", required=True, help="objects_vocab.txt (1600 lines)")
    convert.add_argument("--attributes-vocab", required=True, help="attributes_vocab.txt (400 lines)")
    convert.add_argument("--images-subdir", default="", help="prefix of every file_name, e.g. VG_100K/")
    convert.add_argument("--out", required=True, help="the JSON to write")


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    from extraction.config import PRESETS

    parser.add_argument("--images", help="folder the annotations' file names are under")
    parser.add_argument("--annotations", help="training annotations (COCO-style JSON)")
    parser.add_argument("--valid", help="validation annotations: AP picks best/")
    parser.add_argument("--valid-images", help="folder of the validation images (default: --images)")
    parser.add_argument("--out", required=True, help="run directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="network and recipe (default: vg-r101-c4)")
    parser.add_argument(
        "--init",
        help="start from released VG weights (.pkl/.bin/.safetensors), a backbone-only checkpoint or a "
        "detector directory; heads whose classes or attributes differ are rebuilt (default: random)",
    )
    parser.add_argument("--strict", action="store_true", help="stop on bad annotations instead of counting")
    parser.add_argument("--config", help="YAML with train.* and task.* keys (a run's config.yaml works)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, help="global images per step over workers")
    parser.add_argument("--lr", type=float, help="base learning rate")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), help="default: sgd (detectron2)")
    parser.add_argument("--save-every", type=int, help="steps between checkpoints")
    parser.add_argument("--eval-every", type=int, help="steps between validations")
    parser.add_argument("--seed", type=int, help="seed of sampling, augmentation and initialisation")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    parser.add_argument("--workers", type=int, help="Ray Train workers (default: train in this process)")
    parser.add_argument("--cpus-per-worker", type=float, help="CPUs per Ray worker")
    parser.add_argument("--gpus-per-worker", type=float, help="GPUs per Ray worker")
    parser.add_argument("--address", help="Ray cluster for --workers (default: a private local instance)")
    add_overrides_argument(parser, "config overrides, e.g. train.lr=0.01 task.training.freeze_at=3")


def resolve_train_config(args: argparse.Namespace):
    """preset defaults < --config (or, on --resume, the run's own settings) < flags < KEY=VALUE."""
    from pipelines.commands.run_options import resumed_settings
    from pipelines.engine import config_io
    from pipelines.tasks.detection import DetectorTrainRun, default_run

    settings = config_io.load_yaml(args.config) if args.config else resumed_settings(args)
    preset = args.preset
    if preset is None and settings is not None:
        preset = (settings.get("task") or {}).get("preset")
    cfg = default_run(preset) if preset else DetectorTrainRun()
    if settings is not None:
        cfg = config_io.merge(cfg, settings, where=str(args.config or args.out))
    train = {
        "max_steps": args.max_steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "optimizer": args.optimizer,
        "save_every": args.save_every,
        "eval_every": args.eval_every,
        "seed": args.seed,
        "workers": args.workers,
        "cpus_per_worker": args.cpus_per_worker,
        "gpus_per_worker": args.gpus_per_worker,
        "ray_address": args.address,
    }
    task = {
        "images": args.images,
        "annotations": args.annotations,
        "valid": args.valid,
        "valid_images": args.valid_images,
        "preset": args.preset,
        "init": args.init,
        "strict": args.strict or None,
    }
    data = {
        "train": {k: v for k, v in train.items() if v is not None},
        "task": {k: v for k, v in task.items() if v is not None},
    }
    cfg = config_io.apply_overrides(config_io.merge(cfg, data, where="command line"), args.overrides)
    for name in ("images", "annotations"):
        if not getattr(cfg.task, name):
            raise ValueError(f"--{name} is required (or task.{name} in --config)")
    return cfg


CPU_STEPS = 5000  # more optimizer steps than this on a CPU is days of work: said before it starts


def warn_cpu_schedule(cfg) -> None:
    """A warning when a GPU schedule (vg-r101-c4's 90k steps of 16 images, detectron2's) is to run on this
    process's CPU, with the preset and flags that fit one."""
    from extraction.config import SMALL_PRESET
    from pipelines.engine.devices import pick_device

    train = cfg.train
    if train.workers or (train.max_steps or 0) <= CPU_STEPS or pick_device(train.device).type != "cpu":
        return
    log.warning(
        "--preset %s on the CPU: its schedule is %d steps of %d images (detectron2's, for GPUs), weeks of "
        "work here; --preset %s trains in minutes on a CPU, or lower --max-steps",
        cfg.task.preset, train.max_steps, train.batch_size, SMALL_PRESET,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    return {"train": _train, "evaluate": _evaluate, "convert-vg": _convert}[args.action](args)


def _train(args: argparse.Namespace) -> int:
    from pipelines.tasks.detection import train_detector

    out = Path(args.out)
    try:
        cfg = resolve_train_config(args)
        warn_cpu_schedule(cfg)
        summary = train_detector(cfg, out, resume=args.resume)
    except (ValueError, KeyError, OSError, FloatingPointError) as exc:
        print(f"xmodal detector train: {_one_line(exc)}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    best = summary.get("best")
    if best:
        print(
            f"trained to step {summary['step']}; best AP {100 * best['value']:.2f} at step {best['step']}: "
            f"{out / 'best'}"
        )
    else:
        print(f"trained to step {summary['step']}: {out / 'last'} (no --valid: no best/)")
    return 0


def _one_line(exc: BaseException) -> str:
    """The error itself: an image that fails in a DataLoader worker comes back wrapped with the worker's
    traceback, whose last line is the original message."""
    text = str(exc)
    if "Original Traceback" in text:
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1].split(": ", 1)[-1] if lines else type(exc).__name__
    return text


def _evaluate(args: argparse.Namespace) -> int:
    from pipelines.apps.detector_eval import evaluate_weights
    from pipelines.scoring.box_ap import format_table

    try:
        metrics = evaluate_weights(
            args.weights,
            args.images,
            args.annotations,
            preset=args.preset,
            strict=args.strict,
            device=args.device,
        )
    except (ValueError, KeyError, OSError) as exc:
        print(f"xmodal detector evaluate: {exc}", file=sys.stderr)
        return 1
    images = metrics.pop("images")
    print(format_table(metrics))
    print(f"on {images} images")
    # undefined metrics (an area range without ground-truth boxes) are NaN in the table, null in JSON
    defined = {k: (None if math.isnan(v) else v) for k, v in metrics.items()}
    line = json.dumps(
        {"weights": str(args.weights), "annotations": str(args.annotations), "images": images, **defined}
    )
    print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from pipelines.data.detection import convert_visual_genome

    try:
        counts = convert_visual_genome(
            args.objects,
            args.attributes,
            args.image_data,
            args.objects_vocab,
            args.attributes_vocab,
            args.out,
            images_subdir=args.images_subdir,
        )
    except (ValueError, KeyError, OSError) as exc:
        print(f"xmodal detector convert-vg: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items()))
    return 0
