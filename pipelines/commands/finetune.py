"""`xmodal finetune TASK`: fine-tune a pre-trained model on one of the fine-tuning tasks of `TASKS`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pipelines.commands.images_option import add_images_arguments, store_for_rows
from pipelines.commands.run_options import add_run_arguments, resolve_run_config, start_run

EPILOG = """\
data (JSON list, JSON lines, CSV, or a datasets Parquet/Arrow export): VQA/GQA rows {image, question,
answer | answers} or LXMERT's {question_id, img_id, sent, label: {answer: score}}; caption rows {image,
caption}, Karpathy's dataset_coco.json or COCO captions_*.json; NLVR2 rows {identifier, img0, img1, sent,
label: 0|1}. A row's image is looked up in --features as extract stored it (the stem, or the relative
path with --id-from relpath; `sub/a.jpg`, `a.jpg` and `a` find it when unambiguous). With --images DIR
the images the rows name are extracted first into a cache store ($XMODAL_CACHE, else ~/.cache/xmodal),
resumable and reused by later runs.
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
    from pipelines.tasks import finetuning_tasks, get_finetune_task

    parser.add_argument("task", choices=finetuning_tasks(), help="which fine-tuning task")
    add_run_arguments(parser, "files", features_required=False)
    add_images_arguments(parser)
    presets = sorted({name for family in FAMILIES.values() for name in family.config_class.PRESETS})
    parser.add_argument(
        "--preset", choices=presets, help="model size without --init (default: task.preset, else base)"
    )
    parser.add_argument(
        "--arch",
        choices=sorted(FAMILIES),
        help="model family (default: the --init directory's, else task.arch, else lxmert)",
    )
    parser.add_argument(
        "--recipe",
        choices=sorted({r for t in finetuning_tasks() for r in get_finetune_task(t).recipes}),
        help="named settings under the config, flags and KEY=VALUE (caption: xmodal, the default for small "
        "data; self-critical-updown, self-critical.pytorch's Up-Down cross-entropy recipe; "
        "self-critical-updown-scst, its SCST phase)",
    )
    parser.add_argument("--init", help="pre-trained directory (runs/pretrain/last); omitted: random weights")
    parser.add_argument(
        "--vocab",
        help="the words, for every task: a vocab.txt (`xmodal vocab build questions.csv captions.json --out "
        "vocab.txt`; a captioner keeps its whole words) or a run directory holding one; a hub id for the "
        "text tasks (default: the --init directory's, else bert-base-uncased; a captioner's from its "
        "training captions)",
    )
    parser.add_argument(
        "--answers", help="answer table (trainval_ans2label.json); default: from --train labels"
    )
    parser.add_argument(
        "--init-answers",
        metavar="FILE",
        help="the answer table of --init's QA head, to seed the answer head (all_ans.json for the release; "
        "default: the --init directory's ans2label.json)",
    )


def resolve_config(args: argparse.Namespace):
    """The run's settings (defaults < recipe < --config < flags < KEY=VALUE), every one checked against its
    type and range; nothing is read or written yet."""
    from pipelines.tasks.finetune import FinetuneRun
    from pipelines.tasks.finetuned import default_run

    run_cfg = resolve_run_config(
        args,
        FinetuneRun,
        {
            "init": args.init,
            "arch": args.arch,
            "vocab": args.vocab,
            "answers": args.answers,
            "init_answers": args.init_answers,
            "preset": args.preset,
        },
        base=default_run(args.task, args.recipe),
    )
    if run_cfg.task.task != args.task:
        raise ValueError(
            f"task.task={run_cfg.task.task!r} (a {run_cfg.task.task} config) but the command says {args.task}"
        )
    return run_cfg


def run(args: argparse.Namespace) -> int:
    from pipelines.tasks import get_finetune_task
    from pipelines.tasks.finetune import check_labelled
    from pipelines.tasks.finetuned import finetune

    out = Path(args.out)
    try:
        run_cfg = resolve_config(args)
        kind = get_finetune_task(args.task)
        if args.images:  # the rows' labels, then the vocabulary, are checked before any image is extracted
            files = [*run_cfg.task.train_files, *run_cfg.task.valid_files]
            check_labelled(kind.load_examples, files)
            kind.text_vocabulary(run_cfg.task)
            store = store_for_rows(args, kind.load_examples, files)
            run_cfg.task.features = [str(store)]
        elif not run_cfg.task.features:
            raise ValueError("give the features: --features feats.lmdb, or --images DIR to extract them")
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
