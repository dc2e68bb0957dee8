"""`xmodal score`: official files in, the official numbers out (hand-computed here), bad input refused."""

from __future__ import annotations

import json

import pytest

from pipelines.cli import main as xmodal


def _json(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def _run(capsys, *argv):
    rc = xmodal(["score", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_vqa_against_the_official_annotations(tmp_path, capsys):
    def ann(qid, humans, answer_type, question_type):
        answers = [
            {"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(humans)
        ]
        return {
            "question_id": qid,
            "answers": answers,
            "answer_type": answer_type,
            "question_type": question_type,
        }

    gold = _json(
        tmp_path / "annotations.json",
        {
            "annotations": [
                ann(1, ["yes"] * 10, "yes/no", "is the"),
                ann(2, ["2"] * 2 + ["3"] * 8, "number", "how many"),
                ann(3, ["dog"] * 10, "other", "what is"),
            ]
        },
    )
    preds = _json(
        tmp_path / "preds.json",
        [
            {"question_id": 1, "answer": "Yes."},
            {"question_id": 2, "answer": "two"},
            {"question_id": 3, "answer": "a cat"},
        ],
    )
    rc, out, _ = _run(capsys, "vqa", preds, "--gold", gold, "--json")
    assert rc == 0
    scores = json.loads(out)
    # q1: "Yes." normalises to "yes" -> 1; q2: "two" -> "2", 2 of 10 humans: the 10 leave-one-out subsets
    # give 1/3 (the 2 held-out matches) or 2/3 (the 8 others) -> 0.6; q3: 0
    assert scores["accuracy"] == round(100 * (1 + 0.6 + 0) / 3, 2)
    assert scores["per_answer_type"] == {"yes/no": 100.0, "number": 60.0, "other": 0.0}
    assert scores["per_question_type"]["how many"] == 60.0
    assert scores["method"] == "official"
    rc, out, _ = _run(capsys, "vqa", preds, "--gold", gold)
    assert rc == 0 and "accuracy: 53.33" in out and "  number: 60.00" in out


def test_gqa_exact_match_with_the_official_breakdowns(tmp_path, capsys):
    gold = _json(
        tmp_path / "balanced.json",
        {
            "q1": {
                "answer": "gray",
                "isBalanced": True,
                "types": {"structural": "query", "semantic": "attr"},
            },
            "q2": {"answer": "yes", "isBalanced": True, "types": {"structural": "verify", "semantic": "rel"}},
            "q3": {"answer": "man", "isBalanced": True, "types": {"structural": "query", "semantic": "obj"}},
            "q4": {"answer": "no", "isBalanced": False, "types": {"structural": "verify", "semantic": "rel"}},
        },
    )
    preds = [("q1", "grey"), ("q2", "yes"), ("q3", "man"), ("q4", "yes")]
    path = _json(tmp_path / "preds.json", [{"questionId": q, "prediction": p} for q, p in preds])
    rc, out, _ = _run(capsys, "gqa", path, "--gold", gold, "--json")
    scores = json.loads(out)
    assert rc == 0
    # grey is not gray; the unbalanced q4 is not counted
    assert (scores["accuracy"], scores["binary"], scores["open"], scores["questions"]) == (
        66.67,
        100.0,
        50.0,
        3,
    )
    assert scores["per_semantic_type"] == {"attr": 0.0, "obj": 100.0, "rel": 100.0}


def test_nlvr2_csv_against_the_official_json_lines(tmp_path, capsys):
    labels = {"dev-1-0-0": "True", "dev-1-1-0": "False", "dev-2-0-1": "True"}
    gold = tmp_path / "dev.json"
    gold.write_text("".join(json.dumps({"identifier": i, "label": y}) + "\n" for i, y in labels.items()))
    preds = tmp_path / "preds.csv"
    preds.write_text("dev-1-0-0,True\ndev-1-1-0,True\ndev-2-0-1,true\n")
    rc, out, _ = _run(capsys, "nlvr2", str(preds), "--gold", str(gold), "--json")
    scores = json.loads(out)
    assert rc == 0
    assert (scores["accuracy"], scores["consistency"]) == (
        66.67,
        50.0,
    )  # sentence dev-1--0 has one wrong pair


def test_bad_input_is_one_line_and_exit_1(tmp_path, capsys):
    gold = _json(tmp_path / "gold.json", [{"question_id": 1, "label": {"yes": 1.0}}])
    missing = _json(tmp_path / "empty.json", [])
    rc, out, err = _run(capsys, "vqa", missing, "--gold", gold)
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and "1 questions" in err and "no prediction" in err
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    rc, _, err = _run(capsys, "vqa", str(broken), "--gold", gold)
    assert rc == 1 and str(broken) in err and "not valid JSON" in err
    rc, _, err = _run(capsys, "gqa", missing, "--gold", gold, "--questions", gold)
    assert rc == 1 and "give it as --gold" in err
    with pytest.raises(SystemExit) as exit_info:
        xmodal(["score", "pretrain", missing, "--gold", gold])
    assert exit_info.value.code == 1
