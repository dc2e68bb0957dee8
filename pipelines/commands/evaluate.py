"""`xmodal evaluate TASK`: predictions in the official format, and metrics for labelled splits."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipelines.apps.evaluate import DEFAULT_BATCH_SIZE
    from pipelines.commands.images_option import add_images_arguments
    from pipelines.engine.devices import DEFAULT_DEVICE, DEVICE_HELP
    from pipelines.tasks import finetuning_tasks

    parser.add_argument("task", choices=finetuning_tasks(), help="the task the checkpoint was tuned for")
    parser.add_argument("--checkpoint", required=True, help="fine-tuned directory (runs/vqa/best)")
    parser.add_argument(
        "--features", nargs="+", default=[], metavar="LMDB", help="feature stores (or --images DIR)"
    )
    add_images_arguments(parser)
    parser.add_argument(
        "--split",
        nargs="+",
        required=True,
        metavar="JSON",
        help="examples to predict (captions: dataset_coco.json:test, a Karpathy file's split)",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="prediction file: VQA [{question_id, answer}], GQA [{questionId, prediction}] JSON, "
        "NLVR2 identifier,True|False CSV, COCO captions [{image_id, caption}] JSON; metrics go beside it "
        "as <stem>.metrics.json",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_BATCH_SIZE,
        help=f"examples per forward pass (default: {DEFAULT_BATCH_SIZE})",
    )
    parser.add_argument(
        "--beam-size",
        type=int,
        help="captioners: beams per image (default: the run's test beam, task.test_beam_size, else its "
        "validation's)",
    )
    parser.add_argument("--device", default=DEFAULT_DEVICE, help=DEVICE_HELP)


def run(args: argparse.Namespace) -> int:
    from pipelines.apps.evaluate import evaluate, joined_path, metrics_path, recorded_extraction
    from pipelines.commands.images_option import store_for_rows
    from pipelines.tasks import get_finetune_task

    try:
        features = args.features
        if args.images:
            # extracted as the run's training features were (weights, boxes, grid), or refused
            recorded = recorded_extraction(args.checkpoint)
            load = get_finetune_task(args.task).load_examples
            features = [str(store_for_rows(args, load, args.split, args.checkpoint, recorded))]
        elif not features:
            raise ValueError("give the features: --features feats.lmdb, or --images DIR to extract them")
        metrics = evaluate(
            args.checkpoint,
            features,
            args.split,
            args.out,
            task=args.task,
            batch_size=args.batch_size,
            device=args.device,
            beam_size=args.beam_size,
        )
    except (ValueError, KeyError, FileNotFoundError) as exc:
        print(f"xmodal evaluate: {exc}", file=sys.stderr)
        return 1
    print(f"predictions: {args.out} (joined to their examples: {joined_path(args.out)})")
    if metrics is None:
        print("the split has unlabelled examples: no metrics (submit the predictions to the server)")
        return 0
    for name, value in metrics.items():
        print(f"{name}: {value:.2f}" if name != "loss" else f"{name}: {value:.4f}")
    print(f"metrics: {metrics_path(args.out)}")  # the same numbers as JSON: printed once, here above
    return 0
