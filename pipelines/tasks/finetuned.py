"""Fine-tuning runs and their directories: start or resume a run, load `best/` or `last/` back."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from model import get_family
from pipelines.data.answers import AnswerTable
from pipelines.engine.checkpoints import latest_checkpoint
from pipelines.engine.launch import fit
from pipelines.engine.trainer import TrainConfig
from pipelines.jobs.ray_runtime import ray_for_workers
from pipelines.tasks import finetuning_tasks, get_finetune_task
from pipelines.tasks.finetune import DEFAULT_ARCH, RUN_FILE, FinetuneConfig, FinetuneRun, FinetuneTask

log = logging.getLogger(__name__)


def build_task(
    cfg: FinetuneConfig, answers: AnswerTable | None = None, cache_dir: Path | None = None
) -> FinetuneTask:
    """The trainer Task of `cfg.task`, built on `cfg`; `cache_dir`: where its rows and tokens are kept."""
    return get_finetune_task(cfg.task)(cfg, answers=answers, cache_dir=cache_dir)


def default_run(task: str, recipe: str | None = None) -> FinetuneRun:
    """A `task` run with the release's schedule, or with the task's named `recipe`."""
    kind = get_finetune_task(task)
    if recipe is None:
        return FinetuneRun(task=kind.default_config(), train=kind.default_train_config())
    if not kind.recipes:
        with_recipes = [t for t in finetuning_tasks() if get_finetune_task(t).recipes]
        raise ValueError(
            f"--recipe applies to tasks with named recipes ({', '.join(with_recipes)}), not {task}"
        )
    task_cfg, train_cfg = kind.recipe(recipe)
    return FinetuneRun(task=task_cfg, train=train_cfg)


def finetune(run: FinetuneRun, out_dir: str | Path, resume: bool = False) -> dict:
    """Fine-tune into `out_dir` (best/, last/, checkpoints/, metrics.jsonl); returns the run summary.

    On resume the answer table (a captioner's vocabulary) of the newest checkpoint is reused, so labels
    keep their meaning."""
    out_dir = Path(out_dir)
    answers = None
    latest = latest_checkpoint(out_dir / "checkpoints") if resume else None
    if latest is not None and (latest / RUN_FILE).is_file():
        settings = json.loads((latest / RUN_FILE).read_text())
        answers = get_finetune_task(run.task.task).load_outputs(latest, settings)[1]
    # rows converted and text tokenised once per run, reused by a resumed one
    task = build_task(run.task, answers=answers, cache_dir=out_dir / "cache")
    train = fitted_batch(run.train, len(task.train_examples), task.example_noun)
    with ray_for_workers(train.workers, train.ray_address):
        return fit(task, train, out_dir, resume=resume)


def fitted_batch(train: TrainConfig, examples: int, noun: str = "examples") -> TrainConfig:
    """`train` with the batch sized down, with a warning, to a training set smaller than one batch (a
    folder of a few dozen photos): every example is then seen each step, as HF's Trainer and detectron2 run
    a short last batch, instead of a refusal."""
    if examples >= train.batch_size:
        return train
    unit = max(train.workers, int(os.environ.get("WORLD_SIZE", "1"))) * train.grad_accum
    size = examples // unit * unit
    if size == 0:
        return train  # the trainer refuses it, naming --batch-size
    log.warning(
        "the training set has %d %s, fewer than one batch (--batch-size %d): training on batches of %d",
        examples, noun, train.batch_size, size,
    )  # fmt: skip
    return replace(train, batch_size=size)


@dataclass
class Finetuned:
    """A fine-tuned directory loaded for evaluation or questions; `kind` is its task class."""

    task: str
    model: torch.nn.Module
    tokenizer: Any
    answers: AnswerTable | None
    max_length: int
    settings: dict

    @property
    def kind(self) -> type[FinetuneTask]:
        return get_finetune_task(self.task)


def finetuned_run_file(directory: str | Path) -> Path:
    """`directory`'s finetune.json; FileNotFoundError saying why there is none (a run without validation
    keeps no best/: its last/ is named)."""
    directory = Path(directory)
    run_file = directory / RUN_FILE
    last = directory.parent / "last"
    if not run_file.is_file() and directory.name == "best" and (last / RUN_FILE).is_file():
        raise FileNotFoundError(
            f"{directory} does not exist: the run had no validation set (no --valid), so it kept no best "
            f"checkpoint; use {last}"
        )
    if not run_file.is_file():
        raise FileNotFoundError(
            f"{run_file} not found: {directory} is not a fine-tuned directory (use runs/<task>/best or last)"
        )
    return run_file


def load_finetuned(directory: str | Path, device: str | torch.device = "cpu") -> Finetuned:
    """Load `best/`, `last/` or a checkpoint directory written by a fine-tuning task's `save`."""
    directory = Path(directory)
    settings = json.loads(finetuned_run_file(directory).read_text())
    kind = get_finetune_task(settings["task"])
    tokenizer, answers = kind.load_outputs(directory, settings)
    model = kind.load_head(get_family(settings.get("arch", DEFAULT_ARCH)), directory, answers)
    model.to(device).eval()
    return Finetuned(kind.name, model, tokenizer, answers, int(settings["max_length"]), settings)
