"""Validation and `xmodal evaluate` scores: a split's examples as the gold of `pipelines.scoring`, whose
nested results are flattened into `accuracy`, `accuracy/<type>`, `consistency` for the run log.

The examples are LXMERT's JSON rows, so VQA is scored through their soft labels (the official rule
on the normalised prediction, looked up in the label scores: LXMERT's approximation of the 10-human
accuracy); `xmodal score` against the official annotations gives the exact number.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

from pipelines.data.nlvr2 import NLVR2Example
from pipelines.data.qa import QAExample
from pipelines.scoring.gqa import GQAGold, score_gqa
from pipelines.scoring.nlvr2 import score_nlvr2
from pipelines.scoring.vqa import VQAGold, score_vqa


def _check_labelled(keys: list, kind: str) -> None:
    if keys:
        raise ValueError(f"{len(keys)} {kind} have no label (e.g. {keys[0]!r}); cannot score")


def vqa_accuracy(predictions: Mapping[Hashable, str], examples: Sequence[QAExample]) -> dict[str, float]:
    """`accuracy` and `accuracy/<answer_type>` in percent, as `pipelines.scoring.vqa.score_vqa` on the
    examples' soft labels."""
    _check_labelled([ex.question_id for ex in examples if ex.label is None], "questions")
    gold = {
        ex.question_id: VQAGold(
            ex.question_id, label=ex.label, answer_type=ex.answer_type, question_type=ex.question_type
        )
        for ex in examples
    }
    scores = score_vqa(predictions, gold)
    out = {"accuracy": scores["accuracy"]}
    out.update({f"accuracy/{k}": v for k, v in sorted(scores["per_answer_type"].items())})
    return out


def gqa_accuracy(predictions: Mapping[Hashable, str], examples: Sequence[QAExample]) -> dict[str, float]:
    """Exact-match `accuracy` in percent, as `pipelines.scoring.gqa.score_gqa` (no normalisation)."""
    _check_labelled([ex.question_id for ex in examples if ex.label is None], "questions")
    gold = {str(ex.question_id): GQAGold(str(ex.question_id), label=ex.label) for ex in examples}
    scores = score_gqa({str(k): v for k, v in predictions.items()}, gold)
    return {k: v for k, v in scores.items() if k in ("accuracy", "binary", "open")}


def nlvr2_metrics(predictions: Mapping[str, int], examples: Sequence[NLVR2Example]) -> dict[str, float]:
    """`accuracy` and `consistency` in percent of 0/1 predictions, as `pipelines.scoring.nlvr2`."""
    _check_labelled([ex.identifier for ex in examples if ex.label is None], "statements")
    gold = {ex.identifier: bool(ex.label) for ex in examples}
    scores = score_nlvr2({k: bool(int(v)) for k, v in predictions.items()}, gold)
    return {"accuracy": scores["accuracy"], "consistency": scores["consistency"]}
