"""`xmodal demo`: the baselines it reports, and a reduced end-to-end run through every stage."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipelines.cli import main
from pipelines.demo import DemoError, baselines, score_predictions

TRAIN = [
    {"question_id": 1, "question_type": "how many", "label": {"2": 1.0}},
    {"question_id": 2, "question_type": "how many", "label": {"2": 1.0}},
    {"question_id": 3, "question_type": "how many", "label": {"1": 1.0}},
    {"question_id": 4, "question_type": "what color is the", "label": {"red": 1.0}},
    {"question_id": 5, "question_type": "what color is the", "label": {"red": 1.0}},
    {"question_id": 6, "question_type": "what color is the", "label": {"blue": 1.0}},
    {"question_id": 7, "question_type": "is the", "label": {"left": 1.0}},
    {"question_id": 8, "question_type": "is the", "label": {"left": 1.0}},
    {"question_id": 9, "question_type": "is the", "label": {"left": 1.0}},
    {"question_id": 10, "question_type": "is the", "label": {"left": 1.0}},
]
TEST = [
    {"question_id": 11, "question_type": "how many", "label": {"2": 1.0}},
    {"question_id": 12, "question_type": "what color is the", "label": {"blue": 1.0}},
    {"question_id": 13, "question_type": "what color is the", "label": {"red": 0.6, "blue": 0.3}},
    {"question_id": 14, "question_type": "is the", "label": {"right": 1.0}},
]


def test_baselines_by_hand() -> None:
    b = baselines(TRAIN, TEST)
    assert b["majority_answer"] == "left"  # 4 of 10 training answers
    assert b["baseline_accuracy"] == 0.0
    # per type: "2", "red", "left" -> 1.0, 0.0, 0.6, 0.0
    assert b["prior_baseline_accuracy"] == pytest.approx(100 * 1.6 / 4)
    assert b["per_type_prior_baseline"] == {"how many": 100.0, "is the": 0.0, "what color is the": 30.0}


def test_scoring_uses_soft_scores_and_refuses_missing_answers(tmp_path: Path) -> None:
    preds = tmp_path / "p.json"
    preds.write_text(json.dumps([{"question_id": q, "answer": a} for q, a in
                                 [(11, "2"), (12, "red"), (13, "blue"), (14, "right")]]))  # fmt: skip
    scored = score_predictions(preds, TEST)
    assert scored["accuracy"] == pytest.approx(100 * (1 + 0 + 0.3 + 1) / 4, abs=0.01)
    assert scored["per_type_accuracy"]["what color is the"] == pytest.approx(15.0)
    preds.write_text(json.dumps([{"question_id": 11, "answer": "2"}]))
    with pytest.raises(DemoError, match="no answer for 3 test questions"):
        score_predictions(preds, TEST)


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    assert main(["demo", "--workdir", str(workdir), "--quick", "--images", "24", "--seed", "1"]) == 0

    summary = json.loads((workdir / "summary.json").read_text())
    for key in ("accuracy", "baseline_accuracy", "prior_baseline_accuracy", "elapsed_s", "stage_s"):
        assert key in summary, key
    assert summary["detector_weights"] == "random"
    stages = ("generate", "extract", "pretrain", "finetune", "evaluate", "ask", "report")
    assert list(summary["stage_s"]) == list(stages)

    test_rows = json.loads((workdir / "data" / "vqa_test.json").read_text())
    assert summary["test_questions"] == len(test_rows)
    rescored = score_predictions(workdir / "runs" / "vqa" / "test_predictions.json", test_rows)
    assert rescored["accuracy"] == summary["accuracy"]
    assert summary["evaluate_accuracy"] == pytest.approx(
        summary["accuracy"], abs=0.01
    )  # `xmodal evaluate`'s own

    from storage import FeatureReader

    reader = FeatureReader(workdir / "features.lmdb")
    assert len(reader) == 24
    reader.close()
    assert (workdir / "runs" / "pretrain" / "metrics.jsonl").is_file()

    report = workdir / "report.html"
    text = report.read_text()
    assert "RANDOM DETECTOR WEIGHTS" in text
    links = [report.parent / src for src in re.findall(r'<img src="([^"]+)"', text)]
    assert len(links) >= 5  # accuracy, curves, three detection pictures (+ the attention picture)
    assert all(link.is_file() for link in links)
