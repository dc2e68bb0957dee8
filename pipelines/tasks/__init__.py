"""The tasks models train on: pre-training and one class per fine-tuning task, named in `TASKS`."""

from __future__ import annotations

from pipelines.tasks.caption import CaptionTask
from pipelines.tasks.finetune import FinetuneTask
from pipelines.tasks.nlvr2 import NLVR2Task
from pipelines.tasks.pretrain import PretrainTask
from pipelines.tasks.qa import GQATask, VQATask
from pipelines.tasks.retrieval import RetrievalTask

# the one place a task name meets its class; a new task is one module plus one row here
TASKS: dict[str, type] = {
    "pretrain": PretrainTask,
    "vqa": VQATask,
    "gqa": GQATask,
    "nlvr2": NLVR2Task,
    "retrieval": RetrievalTask,
    "caption": CaptionTask,
}


def finetuning_tasks() -> tuple[str, ...]:
    """The names of the fine-tuning tasks (the CLI's choices for finetune and evaluate)."""
    return tuple(name for name, cls in TASKS.items() if issubclass(cls, FinetuneTask))


def get_finetune_task(name: str) -> type[FinetuneTask]:
    """The fine-tuning task class called `name`."""
    if name not in finetuning_tasks():
        raise ValueError(f"unknown task {name!r}; choose one of {list(finetuning_tasks())}")
    return TASKS[name]
