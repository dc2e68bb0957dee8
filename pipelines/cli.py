"""The `xmodal` command line: one subcommand per module in `pipelines.commands`."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import warnings

# (subcommand, one-line help); each lives in pipelines/commands/<name>.py
COMMANDS: tuple[tuple[str, str], ...] = (
    ("features", "inspect, verify, import, export, merge and draw region-feature stores"),
    ("extract", "extract region features from image folders with Ray"),
    ("detector", "train and evaluate the detector on your own boxes and attributes"),
    ("submit", "submit any xmodal command to a Ray cluster as a Ray Job"),
    ("convert", "convert detector, LXMERT, ViLBERT, VL-BERT or VisualBERT checkpoints"),
    ("vocab", "build a WordPiece vocabulary"),
    ("pretrain", "pre-train a model (LXMERT: the five tasks)"),
    ("finetune", "fine-tune on a task (vqa, gqa, nlvr2, retrieval, caption)"),
    ("evaluate", "evaluate a fine-tuned checkpoint and write prediction files"),
    ("score", "score a prediction file against the gold answers as the official evaluators do"),
    ("ask", "ask a question about one image, or caption it"),
    ("serve", "a web page and JSON API that answer questions about uploaded images and caption them"),
    ("demo", "run the whole pipeline on generated data"),
    ("generate", "DALL-E: train the tokenizer and transformer, sample, evaluate"),
)

# every command exits with one of these (`xmodal submit` passes the remote command's status through)
EXIT_OK, EXIT_BAD_INPUT, EXIT_PARTIAL = 0, 1, 2
EXIT_INTERRUPTED = 130  # the shell's status for Ctrl-C (128 + SIGINT)
EXIT_CODES = """\
exit status (every command):
  0  success
  1  bad input or refusal: a missing or malformed file, a bad option, settings that do not fit
  2  partial failure: the work finished but some of it failed (extract: more than --max-failures images)
  130  stopped by Ctrl-C (extract, --images: what is done is kept; rerun the same command to resume)
"""


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line and exit with the bad-input status (argparse's own
    is 2)."""

    def error(self, message: str):
        # one line, as every other refusal: the usage is a `--help` away
        # (an argument holding a newline or other control character is shown escaped)
        shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {shown} (see {self.prog} --help)\n")


def _version() -> str:
    """The installed package's version (the source tree's when run without installing)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xmodal")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="xmodal",
        description=__doc__,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"xmodal {_version()}")
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


def _warning_to_log(message, category, filename, lineno, file=None, line=None) -> None:
    """A library warning (random detector weights) as one log line, without the source line; Python's
    warning registry already shows each once per command."""
    logging.getLogger("py.warnings").warning("%s", message)


def main(argv: list[str] | None = None) -> int:
    from pipelines.jobs.home import private_home

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    warnings.showwarning = _warning_to_log
    try:
        private_home()  # before Ray or a cache writes under ~
    except PermissionError as exc:
        print(f"xmodal: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt as exc:
        # Ctrl-C: one line (what was kept and how to go on, when the command says), never a traceback
        print(f"xmodal {args.command}: {exc or 'stopped (Ctrl-C)'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader stopped early (`xmodal features info | head`): what it read is all it wanted. Point
        # stdout at /dev/null so the flush at exit does not raise again, and end quietly.
        with contextlib.suppress(OSError, ValueError):  # a stdout with no descriptor (tests) needs none
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
