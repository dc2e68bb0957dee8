"""Prediction files in the formats the official evaluation servers and scripts take."""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping
from pathlib import Path


def write_vqa_predictions(path: str | Path, answers: Mapping[Hashable, str]) -> Path:
    """VQA (EvalAI) result file: a JSON list of `{"question_id": int, "answer": str}`."""
    rows = [{"question_id": qid, "answer": answer} for qid, answer in answers.items()]
    return _write_json(path, rows)


def write_gqa_predictions(path: str | Path, answers: Mapping[Hashable, str]) -> Path:
    """GQA result file: a JSON list of `{"questionId": str, "prediction": str}`."""
    rows = [{"questionId": str(qid), "prediction": answer} for qid, answer in answers.items()]
    return _write_json(path, rows)


def write_nlvr2_predictions(path: str | Path, labels: Mapping[str, int]) -> Path:
    """NLVR2 CSV for the official `metrics.py`: `identifier,True|False` per line, no header."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bad = [i for i in labels if "," in i or "\n" in i]
    if bad:
        raise ValueError(f"NLVR2 identifiers cannot hold commas or newlines in the CSV, e.g. {bad[0]!r}")
    with path.open("w", encoding="utf-8", newline="") as f:
        for ident, label in labels.items():
            f.write(f"{ident},{'True' if int(label) else 'False'}\n")
    return path


def _write_json(path: str | Path, rows: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows) + "\n", encoding="utf-8")
    return path
