"""Score a prediction file without a model, as the official evaluators do, and print the result."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.tasks import get_finetune_task


def score(task: str, predictions: str | Path, gold: str | Path, questions: str | Path | None = None) -> dict:
    """The scores of `predictions` (the task's official result file) against `gold`: `accuracy` in percent
    and the task's breakdowns (see pipelines.scoring). Malformed input raises ScoringInputError."""
    return get_finetune_task(task).score_files(predictions, gold, questions)


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
