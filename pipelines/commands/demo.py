"""`xmodal demo`: the whole pipeline on generated scenes, ending in report.html and summary.json."""

from __future__ import annotations

import argparse
import json
import logging

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipelines.apps.demo.demo import DemoConfig
    from pipelines.commands.run_options import config_default

    workdir, seed = config_default(DemoConfig, "workdir"), config_default(DemoConfig, "seed")
    parser.add_argument(
        "--workdir",
        default=workdir,
        help=f"where data, features, runs and the report go (default: {workdir})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=seed,
        help=f"seed of the scenes and of training; the same seed gives the same numbers (default: {seed})",
    )
    parser.add_argument("--images", type=int, help="number of generated images (default: 300; --quick: 60)")
    parser.add_argument(
        "--weights",
        help="a detector checkpoint (faster_rcnn_from_caffe_attr.pkl, ...) to extract with instead of the "
        "detector the demo trains on its scenes",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a tiny run that checks every stage, in a few minutes (longer on a busy machine)",
    )


def run(args: argparse.Namespace) -> int:
    from pipelines.apps.demo.demo import DemoConfig, DemoError, run_demo
    from pipelines.cli import main

    kw = {"workdir": args.workdir, "seed": args.seed, "weights": args.weights}
    if args.images is not None:
        kw["images"] = args.images
    cfg = DemoConfig.quick(**kw) if args.quick else DemoConfig(**kw)
    try:
        summary = run_demo(cfg, xmodal=main)
    except DemoError as exc:
        log.error("%s", exc)
        return 1
    keys = (
        "detector",
        "probe",
        "accuracy",
        "baseline_accuracy",
        "prior_baseline_accuracy",
        "margin_points",
        "margin_over_prior_points",
        "elapsed_s",
        "report",
    )
    print(json.dumps({k: summary.get(k) for k in keys}, indent=1))
    return 0
