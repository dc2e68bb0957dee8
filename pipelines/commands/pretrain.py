"""`xmodal pretrain`: pre-train a model family (LXMERT's five tasks) over region-feature stores."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipelines.commands.run_options import add_run_arguments, resolve_run_config, start_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, "pre-training JSON files")
    parser.add_argument("--vocab", help="vocab.txt or hub id (default: task.vocab)")
    from model import FAMILIES

    parser.add_argument("--arch", choices=sorted(FAMILIES), help="model family (default: task.arch)")
    presets = sorted({name for family in FAMILIES.values() for name in family.config_class.PRESETS})
    parser.add_argument("--preset", choices=presets, help="model size (default: task.preset)")
    parser.add_argument(
        "--answers", help="answer table JSON to load (ans2label dict or list) instead of building"
    )


def resolve_config(args: argparse.Namespace):
    """The run's settings (defaults < --config < flags < KEY=VALUE), every one checked against its type and
    range; nothing is read or written yet."""
    from pipelines.tasks.pretrain import PretrainRun

    flags = {"arch": args.arch, "vocab": args.vocab, "preset": args.preset, "answers": args.answers}
    return resolve_run_config(args, PretrainRun, flags)


def run(args: argparse.Namespace) -> int:
    from pipelines.tasks.pretrain import pretrain

    out = Path(args.out)
    try:
        run_cfg = resolve_config(args)
        summary = pretrain(run_cfg, out, resume=start_run(args))
    except (ValueError, KeyError, OSError) as exc:
        print(f"xmodal pretrain: {exc}", file=sys.stderr)
        return 1
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank runs this command
        print(f"pre-trained to step {summary['step']}: {out / 'last'}")
    return 0
