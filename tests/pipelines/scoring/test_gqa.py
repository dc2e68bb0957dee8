"""GQA scoring: exact match, balanced questions only, per-type breakdowns, against a restatement."""

from __future__ import annotations

import json
import random

import pytest

from pipelines.scoring.gqa import GQAGold, read_gqa_gold, read_gqa_predictions, score_gqa, score_gqa_files
from pipelines.scoring.inputs import ScoringInputError

# (gold, prediction): none of these is credited, as neither the official script nor LXMERT normalises
NEAR_MISSES = [
    ("gray", "grey"),
    ("man", "the man"),
    ("2", "two"),
    ("yes", "Yes"),
    ("yes", "yes."),
    ("no", " no"),
]


def ref_scores(questions: dict, predictions: dict) -> dict:
    """The official eval.py's accuracy part, restated: balanced questions, == on the strings."""
    kept = {q: v for q, v in questions.items() if v["isBalanced"]}
    hit = {q: 1 if predictions[q] == v["answer"] else 0 for q, v in kept.items()}

    def pct(ids):
        return round(100 * sum(hit[i] for i in ids) / len(ids), 2)

    out = {"accuracy": pct(list(hit))}
    out["open"] = pct([q for q, v in kept.items() if v["types"]["structural"] == "query"])
    out["binary"] = pct([q for q, v in kept.items() if v["types"]["structural"] != "query"])
    for kind in ("structural", "semantic"):
        names = {v["types"][kind] for v in kept.values()}
        out[kind] = {n: pct([q for q, v in kept.items() if v["types"][kind] == n]) for n in names}
    return out


def test_near_misses_score_zero_and_exact_answers_one():
    gold = {str(i): {"answer": g, "isBalanced": True} for i, (g, _) in enumerate(NEAR_MISSES)}
    wrong = {str(i): p for i, (_, p) in enumerate(NEAR_MISSES)}
    right = {str(i): g for i, (g, _) in enumerate(NEAR_MISSES)}
    truth = {q: GQAGold(q, answer=v["answer"]) for q, v in gold.items()}
    assert score_gqa(wrong, truth)["accuracy"] == 0.0
    assert score_gqa(right, truth)["accuracy"] == 100.0


def test_official_questions_file_scores_as_the_restatement(tmp_path):
    rng = random.Random(1)
    answers = [a for pair in NEAR_MISSES for a in pair]
    questions, predictions = {}, []
    for i in range(400):
        qid = f"{20000000 + i}"
        questions[qid] = {
            "question": "?",
            "imageId": "n1",
            "answer": rng.choice(answers),
            "isBalanced": rng.random() < 0.8,
            "types": {
                "structural": rng.choice(["query", "verify", "logical", "choose", "compare"]),
                "semantic": rng.choice(["attr", "obj", "rel", "cat", "global"]),
                "detailed": "x",
            },
        }
        predictions.append({"questionId": qid, "prediction": rng.choice(answers)})
    predictions.append({"questionId": "unscored", "prediction": "yes"})  # ignored, as officially
    (tmp_path / "testdev_balanced_questions.json").write_text(json.dumps(questions))
    (tmp_path / "pred.json").write_text(json.dumps(predictions))

    got = score_gqa_files(tmp_path / "pred.json", tmp_path / "testdev_balanced_questions.json")

    want = ref_scores(questions, {p["questionId"]: p["prediction"] for p in predictions})
    assert got["questions"] == sum(v["isBalanced"] for v in questions.values())
    assert (got["accuracy"], got["open"], got["binary"]) == (want["accuracy"], want["open"], want["binary"])
    assert got["per_structural_type"] == want["structural"]
    assert got["per_semantic_type"] == want["semantic"]


def test_lxmert_rows_are_exact_match_through_the_label(tmp_path):
    rows = [
        {"question_id": "1", "img_id": "n1", "sent": "?", "label": {"gray": 1.0}},
        {"question_id": "2", "img_id": "n1", "sent": "?", "label": {"man": 1.0}},
        {"question_id": "3", "img_id": "n1", "sent": "?", "label": {"yes": 1.0}},
    ]
    (tmp_path / "testdev.json").write_text(json.dumps(rows))
    got = score_gqa({"1": "grey", "2": "man", "3": "Yes"}, read_gqa_gold(tmp_path / "testdev.json"))
    assert got == {"accuracy": 33.33, "questions": 3}


def test_a_missing_prediction_and_bad_rows_are_named(tmp_path):
    (tmp_path / "q.json").write_text(json.dumps({"7": {"answer": "yes", "isBalanced": True}}))
    (tmp_path / "p.json").write_text(json.dumps([{"questionId": "8", "prediction": "yes"}]))
    with pytest.raises(ScoringInputError, match="1 questions of .*q.json have no prediction"):
        score_gqa_files(tmp_path / "p.json", tmp_path / "q.json")
    (tmp_path / "p.json").write_text(json.dumps([{"questionId": "7", "prediction": None}]))
    with pytest.raises(ScoringInputError, match=r"p.json row 0 \(question 7\): 'prediction' is None"):
        read_gqa_predictions(tmp_path / "p.json")
    (tmp_path / "q.json").write_text(json.dumps({"7": {"isBalanced": True}}))
    with pytest.raises(ScoringInputError, match="q.json question '7': no 'answer' field"):
        read_gqa_gold(tmp_path / "q.json")
