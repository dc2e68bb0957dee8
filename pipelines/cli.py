"""The `xmodal` command line: one subcommand per module in `pipelines.commands`."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

# (subcommand, one-line help); each lives in pipelines/commands/<name>.py
COMMANDS: tuple[tuple[str, str], ...] = (
    ("features", "inspect, verify, import, export, merge and draw region-feature stores"),
    ("extract", "extract region features from image folders with Ray"),
    ("submit", "submit any xmodal command to a Ray cluster as a Ray Job"),
    ("convert", "convert detector, LXMERT, VL-BERT or VisualBERT checkpoints"),
    ("vocab", "build a WordPiece vocabulary"),
    ("pretrain", "pre-train LXMERT on the five tasks"),
    ("finetune", "fine-tune on VQA, GQA or NLVR2"),
    ("evaluate", "evaluate a fine-tuned checkpoint and write prediction files"),
    ("ask", "ask a question about one image"),
    ("demo", "run the whole pipeline on generated data"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xmodal", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS:
        module_name = f"pipelines.commands.{name}"
        if importlib.util.find_spec(module_name) is None:
            continue
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
