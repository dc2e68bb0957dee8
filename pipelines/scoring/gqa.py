"""GQA accuracy as the official evaluation (and LXMERT's evaluator) computes it: exact string match.

No normalisation at all: "Yes" is not "yes", "gray" is not "grey", "2" is not "two". With the balanced
questions JSON the official breakdowns follow: binary/open (open = structural type "query") and
accuracy per structural and per semantic type, over the questions marked `isBalanced`.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from pipelines.scoring.inputs import ScoringInputError, load_json, missing_error, required, rows_of


@dataclass(frozen=True)
class GQAGold:
    """One question's truth: the answer and its types (official JSON), or LXMERT's `label` scores."""

    question_id: str
    answer: str | None = None
    label: dict[str, float] | None = field(default=None, compare=False)
    structural: str | None = None
    semantic: str | None = None


def question_score(prediction: str, truth: GQAGold) -> float:
    """1 for the exact gold answer, else 0; with LXMERT's labels, the label's score of the prediction."""
    if truth.answer is not None:
        return float(prediction == truth.answer)
    return float((truth.label or {}).get(prediction, 0.0))


def score_gqa(predictions: Mapping[str, str], gold: Mapping[str, GQAGold], source: str | None = None) -> dict:
    """Accuracy in percent (two decimals); `binary`, `open`, `per_structural_type`, `per_semantic_type`
    where the gold carries types. Every gold question needs a prediction; other predictions are ignored
    (the official script scores the balanced questions and takes predictions for all of them)."""
    if not gold:
        raise ScoringInputError(f"{source or 'the gold set'}: no questions to score")
    missing = [qid for qid in gold if qid not in predictions]
    if missing:
        raise missing_error("questions", missing, source)
    scores: list[float] = []
    by_answer: dict[str, list[float]] = defaultdict(list)
    by_structural: dict[str, list[float]] = defaultdict(list)
    by_semantic: dict[str, list[float]] = defaultdict(list)
    for qid, truth in gold.items():
        score = question_score(predictions[qid], truth)
        scores.append(score)
        if truth.structural is not None:
            by_answer["open" if truth.structural == "query" else "binary"].append(score)
            by_structural[truth.structural].append(score)
        if truth.semantic is not None:
            by_semantic[truth.semantic].append(score)
    out: dict = {"accuracy": _percent(scores)}
    for name in ("binary", "open"):
        if by_answer[name]:
            out[name] = _percent(by_answer[name])
    if by_structural:
        out["per_structural_type"] = {k: _percent(v) for k, v in sorted(by_structural.items())}
    if by_semantic:
        out["per_semantic_type"] = {k: _percent(v) for k, v in sorted(by_semantic.items())}
    out["questions"] = len(scores)
    return out


def _percent(scores: list[float]) -> float:
    return round(100 * sum(scores) / len(scores), 2)


def read_gqa_gold(path: str | os.PathLike) -> dict[str, GQAGold]:
    """Question id -> truth from the official questions JSON `{qid: {"answer", "types", "isBalanced",
    ...}}` (only balanced questions are kept, as the official accuracy counts) or LXMERT's rows
    `[{"question_id", "label": {answer: score}}, ...]`."""
    data = load_json(path)
    if isinstance(data, dict):
        return _official_gold(data, path)
    if isinstance(data, list):
        return _lxmert_gold(data, path)
    raise ScoringInputError(f"{path}: neither GQA questions ({{qid: {{...}}}}) nor LXMERT's JSON rows")


def _official_gold(data: dict, path: str | os.PathLike) -> dict[str, GQAGold]:
    gold: dict[str, GQAGold] = {}
    for qid, question in data.items():
        where = f"{path} question {qid!r}"
        if not isinstance(question, dict):
            raise ScoringInputError(f"{where}: expected an object, got {type(question).__name__}")
        if not question.get("isBalanced", True):
            continue
        answer = required(question, "answer", str, where)
        types = question.get("types")
        if types is not None and not isinstance(types, dict):
            raise ScoringInputError(f"{where}: 'types' is {types!r}, not an object")
        types = types or {}
        gold[qid] = GQAGold(
            qid,
            answer=answer,
            structural=required(types, "structural", str, where) if "structural" in types else None,
            semantic=required(types, "semantic", str, where) if "semantic" in types else None,
        )
    return gold


def _lxmert_gold(rows: list, path: str | os.PathLike) -> dict[str, GQAGold]:
    gold: dict[str, GQAGold] = {}
    for i, row in enumerate(rows_of(rows, path, "questions")):
        where = f"{path} row {i}"
        qid = str(required(row, "question_id", (str, int), where))
        if "label" not in row:
            raise ScoringInputError(f"{where} (question {qid}): no 'label': this split is unlabelled")
        label = required(row, "label", dict, where)
        for answer, score in label.items():
            if isinstance(score, bool) or not isinstance(score, (int, float)):
                raise ScoringInputError(f"{where} (question {qid}): label score of {answer!r} is {score!r}")
        if qid in gold:
            raise ScoringInputError(f"{where}: question {qid} appears twice")
        gold[qid] = GQAGold(qid, label={str(k): float(v) for k, v in label.items()})
    return gold


def read_gqa_predictions(path: str | os.PathLike) -> dict[str, str]:
    """Question id -> prediction from `[{"questionId": str, "prediction": str}, ...]`."""
    predictions: dict[str, str] = {}
    for i, row in enumerate(rows_of(load_json(path), path, "predictions")):
        where = f"{path} row {i}"
        qid = str(required(row, "questionId", (str, int), where))
        if qid in predictions:
            raise ScoringInputError(f"{where}: question {qid} is predicted twice")
        predictions[qid] = required(row, "prediction", str, f"{where} (question {qid})")
    return predictions


def score_gqa_files(predictions: str | os.PathLike, gold: str | os.PathLike) -> dict:
    """`score_gqa` of a predictions file against the balanced questions (or LXMERT) file."""
    return score_gqa(read_gqa_predictions(predictions), read_gqa_gold(gold), source=str(gold))
