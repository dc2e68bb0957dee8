"""`xmodal score TASK PREDICTIONS --gold FILE`: official scores of a prediction file, no model needed."""

from __future__ import annotations

import argparse
import sys

EPILOG = """\
prediction files (what `xmodal evaluate` writes):
  vqa    JSON [{"question_id": int, "answer": str}, ...]
  gqa    JSON [{"questionId": str, "prediction": str}, ...]
  nlvr2  CSV  identifier,True|False per line, no header
  caption    JSON [{"image_id": int, "caption": str}, ...] (COCO caption results)
  retrieval  JSON [{"caption_id": str, "images": [image ids, best first]}, ...] (at least the 10 best)
gold files:
  vqa    the official annotations JSON (exact VQA v2 accuracy as vqaEval.py --evaluator 2021, the
         repository's current script, or 2017, the one papers up to 2021 used; --questions checks the
         questions file of the same split), or LXMERT's JSON rows with soft `label` scores (LXMERT's
         approximation)
  gqa    the official questions JSON (balanced questions; binary/open and per-type breakdowns), or
         LXMERT's JSON rows
  nlvr2  the official JSON lines, or LXMERT's JSON list
  caption    COCO captions_*.json, or Karpathy's dataset_coco.json[:test|:val]; the captioned images are
             scored (BLEU, METEOR, ROUGE-L, CIDEr-D, SPICE as pycocoevalcap; Java metrics need a JRE)
  retrieval  the split's captions: rows [{"img_id", "sentences": [...]}] or Karpathy's dataset_*.json#test
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipelines.tasks import finetuning_tasks, get_finetune_task

    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("task", choices=finetuning_tasks(), help="the task the predictions answer")
    parser.add_argument("predictions", help="the prediction file, in the task's official format")
    parser.add_argument("--gold", required=True, metavar="FILE", help="the gold answers (see below)")
    parser.add_argument(
        "--questions", metavar="FILE", help="VQA: the official questions JSON of the gold's split"
    )
    parser.add_argument(
        "--evaluator",
        choices=sorted({v for t in finetuning_tasks() for v in get_finetune_task(t).evaluators}),
        help="the version of the official script, where a task has several (vqa: vqaEval.py 2021 by default)",
    )
    parser.add_argument("--json", action="store_true", help="print the scores as JSON")


def run(args: argparse.Namespace) -> int:
    from pipelines.apps.score import format_scores, score

    try:
        scores = score(args.task, args.predictions, args.gold, args.questions, args.evaluator)
    except ValueError as exc:
        print(f"xmodal score: {exc}", file=sys.stderr)
        return 1
    print(format_scores(scores, as_json=args.json))
    return 0
