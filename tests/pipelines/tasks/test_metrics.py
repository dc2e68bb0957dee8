"""Metrics against hand-computed examples: VQA soft scores per answer type, GQA, NLVR2 consistency."""

from __future__ import annotations

import pytest

from pipelines.data.nlvr2 import NLVR2Example
from pipelines.data.qa import QAExample
from pipelines.tasks.metrics import gqa_accuracy, nlvr2_metrics, nlvr2_sentence_key, vqa_accuracy


def test_vqa_soft_accuracy_overall_and_per_type():
    examples = [
        QAExample(1, "a", "q", {"red": 1.0, "blue": 0.3}, "other"),
        QAExample(2, "a", "q", {"red": 1.0, "blue": 0.3}, "other"),
        QAExample(3, "b", "q", {"2": 0.6, "3": 0.9}, "number"),
        QAExample(4, "b", "q", {"yes": 1.0}, "yes/no"),
        QAExample(5, "b", "q", {"no": 1.0}, "yes/no"),
    ]
    preds = {1: "red", 2: "blue", 3: "2", 4: "yes", 5: "dog"}
    m = vqa_accuracy(preds, examples)
    # 1.0 + 0.3 + 0.6 + 1.0 + 0.0 = 2.9 over 5 questions
    assert m["accuracy"] == pytest.approx(58.0)
    assert m["accuracy/other"] == pytest.approx(65.0)
    assert m["accuracy/number"] == pytest.approx(60.0)
    assert m["accuracy/yes/no"] == pytest.approx(50.0)


def test_unnormalised_label_keys_still_credit_the_table_answer():
    examples = [QAExample(1, "a", "q", {"Two": 0.6, "three.": 0.3}), QAExample(2, "a", "q", {"the dog": 1.0})]
    assert vqa_accuracy({1: "2", 2: "dog"}, examples)["accuracy"] == pytest.approx(80.0)
    assert vqa_accuracy({1: "3", 2: "cat"}, examples)["accuracy"] == pytest.approx(15.0)


def test_vqa_accuracy_refuses_missing_predictions_and_labels():
    examples = [QAExample(1, "a", "q", {"red": 1.0}), QAExample(2, "a", "q", {"red": 1.0})]
    with pytest.raises(ValueError, match="1 questions have no prediction"):
        vqa_accuracy({1: "red"}, examples)
    with pytest.raises(ValueError, match="no label"):
        vqa_accuracy({1: "red"}, [QAExample(1, "a", "q", None)])


def test_gqa_accuracy_exact_match():
    answers = ["left", "no", "cat", "red"]
    examples = [QAExample(f"q{i}", "a", "s", {ans: 1.0}) for i, ans in enumerate(answers)]
    m = gqa_accuracy({"q0": "left", "q1": "yes", "q2": "cat", "q3": "blue"}, examples)
    assert m == {"accuracy": pytest.approx(50.0)}


def test_nlvr2_accuracy_and_consistency_group_by_sentence():
    # sentence 0 of set 10 is paired with 3 image pairs; sentence 1 of set 10 with 2; set 11 has one.
    labels = {
        "dev-10-0-0": 1,
        "dev-10-1-0": 0,
        "dev-10-2-0": 1,
        "dev-10-0-1": 0,
        "dev-10-1-1": 1,
        "dev-11-0-0": 1,
    }
    examples = [NLVR2Example(i, "l", "r", "s", y) for i, y in labels.items()]
    preds = dict(labels)
    preds["dev-10-1-1"] = 0  # one error in sentence 1 of set 10
    m = nlvr2_metrics(preds, examples)
    assert m["accuracy"] == pytest.approx(100.0 * 5 / 6)
    # groups: dev-10--0 (all right), dev-10--1 (one wrong), dev-11--0 (right) -> 2 of 3 consistent
    assert m["consistency"] == pytest.approx(100.0 * 2 / 3)
    assert nlvr2_sentence_key("test1-3-2-1") == "test1-3--1"
    assert nlvr2_sentence_key("odd") == "odd"


def test_nlvr2_all_right_is_fully_consistent_and_all_wrong_is_zero():
    ids = [(s, p) for s in range(3) for p in range(2)]
    examples = [NLVR2Example(f"dev-{s}-{p}-0", "l", "r", "x", (s + p) % 2) for s, p in ids]
    right = {ex.identifier: ex.label for ex in examples}
    wrong = {ex.identifier: 1 - ex.label for ex in examples}
    assert nlvr2_metrics(right, examples) == {"accuracy": 100.0, "consistency": 100.0}
    assert nlvr2_metrics(wrong, examples) == {"accuracy": 0.0, "consistency": 0.0}
