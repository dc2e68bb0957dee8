"""`xmodal score TASK PREDICTIONS --gold FILE`: official scores of a prediction file, no model needed."""

from __future__ import annotations

import argparse
import sys

EPILOG = """\
prediction files (what `xmodal evaluate` writes):
  vqa    JSON [{"question_id": int, "answer": str}, ...]
  gqa    JSON [{"questionId": str, "prediction": str}, ...]
  nlvr2  CSV  identifier,True|False per line, no header
gold files:
  vqa    the official annotations JSON (exact VQA v2 accuracy; --questions checks the questions file of
         the same split), or LXMERT's JSON rows with soft `label` scores (LXMERT's approximation)
  gqa    the official questions JSON (balanced questions; binary/open and per-type breakdowns), or
         LXMERT's JSON rows
  nlvr2  the official JSON lines, or LXMERT's JSON list
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipelines.tasks import finetuning_tasks

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("task", choices=finetuning_tasks(), help="the task the predictions answer")
    parser.add_argument("predictions", help="the prediction file, in the task's official format")
    parser.add_argument("--gold", required=True, metavar="FILE", help="the gold answers (see below)")
    parser.add_argument(
        "--questions", metavar="FILE", help="VQA: the official questions JSON of the gold's split"
    )
    parser.add_argument("--json", action="store_true", help="print the scores as JSON")


def run(args: argparse.Namespace) -> int:
    from pipelines.apps.score import format_scores, score

    try:
        scores = score(args.task, args.predictions, args.gold, args.questions)
    except ValueError as exc:
        print(f"xmodal score: {exc}", file=sys.stderr)
        return 1
    print(format_scores(scores, as_json=args.json))
    return 0
