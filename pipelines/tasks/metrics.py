"""Evaluation metrics: VQA soft accuracy, GQA accuracy, NLVR2 accuracy and consistency."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence

from pipelines.data.answers import normalize_answer
from pipelines.data.nlvr2 import NLVR2Example
from pipelines.data.qa import QAExample


def _missing(kind: str, missing: list) -> ValueError:
    shown = ", ".join(repr(m) for m in missing[:5])
    return ValueError(
        f"{len(missing)} {kind} have no prediction (e.g. {shown}); predict every example before scoring"
    )


def soft_score(label: Mapping[str, float], prediction: str) -> float:
    """The label's score for the predicted answer; keys the file did not normalise are matched after
    `normalize_answer` (so "Two" in a label credits the table answer "2")."""
    if prediction in label:
        return float(label[prediction])
    return max((float(v) for k, v in label.items() if normalize_answer(k) == prediction), default=0.0)


def _check_qa(predictions: Mapping[Hashable, str], examples: Sequence[QAExample]) -> None:
    if not examples:
        raise ValueError("no examples to score")
    missing = [ex.question_id for ex in examples if ex.question_id not in predictions]
    if missing:
        raise _missing("questions", missing)
    unlabelled = [ex.question_id for ex in examples if ex.label is None]
    if unlabelled:
        raise ValueError(f"{len(unlabelled)} questions have no label (e.g. {unlabelled[0]!r}); cannot score")


def vqa_accuracy(predictions: Mapping[Hashable, str], examples: Sequence[QAExample]) -> dict[str, float]:
    """Mean soft score of the predicted answer, overall and per answer type (in %).

    The soft score is the example's `label[answer]` (0 when the answer is not listed): the
    `min(1, humans / 3)`-style score the community files carry, as LXMERT's evaluator reads it.
    Keys: `accuracy`, `accuracy/<answer_type>`.
    """
    _check_qa(predictions, examples)
    total = 0.0
    per_type: dict[str, list[float]] = defaultdict(list)
    for ex in examples:
        score = soft_score(ex.label, predictions[ex.question_id])
        total += score
        if ex.answer_type:
            per_type[ex.answer_type].append(score)
    out = {"accuracy": 100.0 * total / len(examples)}
    for answer_type, scores in sorted(per_type.items()):
        out[f"accuracy/{answer_type}"] = 100.0 * sum(scores) / len(scores)
    return out


def gqa_accuracy(predictions: Mapping[Hashable, str], examples: Sequence[QAExample]) -> dict[str, float]:
    """Exact-match accuracy (in %): GQA labels hold the one correct answer, `{answer: 1.0}`."""
    _check_qa(predictions, examples)
    right = sum(soft_score(ex.label, predictions[ex.question_id]) for ex in examples)
    return {"accuracy": 100.0 * right / len(examples)}


def nlvr2_sentence_key(identifier: str) -> str:
    """The unique-sentence group of an NLVR2 identifier `split-set-pair-sentence`: the pair id blanked.

    This is the official script's grouping (nlvr2/eval/metrics.py): one sentence is written for a set of
    image pairs and is consistent when every pair it was paired with is judged right. Identifiers not in
    that form are their own group.
    """
    parts = identifier.split("-")
    if len(parts) < 4:
        return identifier
    parts[2] = ""
    return "-".join(parts)


def nlvr2_metrics(predictions: Mapping[str, int], examples: Sequence[NLVR2Example]) -> dict[str, float]:
    """Accuracy and consistency (in %) of 0/1 predictions against labelled NLVR2 examples."""
    missing = [ex.identifier for ex in examples if ex.identifier not in predictions]
    if missing:
        raise _missing("statements", missing)
    unlabelled = [ex.identifier for ex in examples if ex.label is None]
    if unlabelled:
        raise ValueError(f"{len(unlabelled)} statements have no label (e.g. {unlabelled[0]!r}); cannot score")
    if not examples:
        raise ValueError("no examples to score")
    right = 0
    consistent: dict[str, bool] = {}
    for ex in examples:
        ok = int(predictions[ex.identifier]) == int(ex.label)
        right += ok
        key = nlvr2_sentence_key(ex.identifier)
        consistent[key] = consistent.get(key, True) and ok
    return {
        "accuracy": 100.0 * right / len(examples),
        "consistency": 100.0 * sum(consistent.values()) / len(consistent),
    }
