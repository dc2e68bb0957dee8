"""Score a prediction file without a model, as the official evaluators do, and print the result."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.tasks import get_finetune_task


def score(
    task: str,
    predictions: str | Path,
    gold: str | Path,
    questions: str | Path | None = None,
    evaluator: str | None = None,
) -> dict:
    """The scores of `predictions` (the task's official result file) against `gold`: the task's metrics
    and breakdowns (see pipelines.scoring); `evaluator` picks a version of the official script where the
    task has several (None: its default). Malformed input raises ScoringInputError."""
    kind = get_finetune_task(task)
    if evaluator is not None and evaluator not in kind.evaluators:
        offered = (
            f"one of {list(kind.evaluators)}" if kind.evaluators else "none: its evaluator has one version"
        )
        raise ValueError(f"--evaluator {evaluator} is not an evaluator of {task} ({offered})")
    return kind.score_files(predictions, gold, questions, evaluator)


def format_scores(scores: dict, as_json: bool = False) -> str:
    """The scores as JSON, or one `name: value` line each with breakdowns indented under their name."""
    if as_json:
        return json.dumps(scores, indent=2)
    lines = []
    for name, value in scores.items():
        if isinstance(value, dict):
            lines.append(f"{name}:")
            lines += [f"  {k}: {_value(v)}" for k, v in value.items()]
        else:
            lines.append(f"{name}: {_value(value)}")
    return "\n".join(lines)


def _value(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)
