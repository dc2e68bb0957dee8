"""`xmodal finetune TASK`: fine-tune a pre-trained model on one of the fine-tuning tasks of `TASKS`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipelines.commands.run_options import add_run_arguments, resolve_run_config, start_run

EPILOG = """\
data: VQA/GQA JSON rows {question_id, img_id, sent, label: {answer: score}}, NLVR2 rows
{identifier, img0, img1, sent, label: 0|1} (JSON list or JSON lines); every image id must be in --features.
defaults (the release's): BertAdam, lr 5e-5 (vqa, nlvr2) / 1e-5 (gqa), batch 32, 4 epochs, warm-up 10%,
clip 5.0.
precedence: task defaults < --config YAML (train.* and task.* keys; a run's config.yaml works) < flags
< KEY=VALUE overrides (e.g. train.grad_accum=2 task.max_length=30 task.model.hidden_dropout_prob=0.2).
The run directory holds best/ (by validation accuracy), last/, checkpoints/, metrics.jsonl, config.yaml
(as the run began), history.jsonl (each start and what changed); best/ and last/ are self-contained for
`xmodal evaluate` and `xmodal ask`. --resume refuses other hyper-parameters by name; --fork RUN goes on
from RUN's last checkpoint with new ones in a new --out.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    from model import FAMILIES
    from pipelines.tasks import finetuning_tasks

    parser.add_argument("task", choices=finetuning_tasks(), help="which fine-tuning task")
    add_run_arguments(parser, "files")
    parser.add_argument(
        "--arch",
        choices=sorted(FAMILIES),
        help="model family (default: the --init directory's, else task.arch, else lxmert)",
    )
    parser.add_argument("--init", help="pre-trained directory (runs/pretrain/last); omitted: random weights")
    parser.add_argument("--vocab", help="vocab.txt or hub id (default: the --init directory's vocab.txt)")
    parser.add_argument(
        "--answers", help="answer table (trainval_ans2label.json); default: from --train labels"
    )
    parser.add_argument(
        "--init-answers",
        metavar="FILE",
        help="the answer table of --init's QA head, to seed the answer head (all_ans.json for the release; "
        "default: the --init directory's ans2label.json)",
    )


def run(args: argparse.Namespace) -> int:
    from pipelines.tasks.finetune import FinetuneRun
    from pipelines.tasks.finetuned import default_run, finetune

    out = Path(args.out)
    try:
        run_cfg = resolve_run_config(
            args,
            FinetuneRun,
            {
                "init": args.init,
                "arch": args.arch,
                "vocab": args.vocab,
                "answers": args.answers,
                "init_answers": args.init_answers,
            },
            base=default_run(args.task),
        )
        if run_cfg.task.task != args.task:
            raise ValueError(f"the config is a {run_cfg.task.task} config but the command says {args.task}")
        summary = finetune(run_cfg, out, resume=start_run(args))
    except (ValueError, KeyError, OSError) as exc:
        print(f"xmodal finetune: {exc}", file=sys.stderr)
        return 1
    best = summary.get("best")
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun every rank runs this command: rank 0 says
        return 0
    if best:
        print(
            f"fine-tuned to step {summary['step']}; best {best['metric']} {best['value']:.2f} at step "
            f"{best['step']}: {out / 'best'}"
        )
    else:
        print(f"fine-tuned to step {summary['step']} (no validation set): {out / 'last'}")
    return 0
