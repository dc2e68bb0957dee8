"""NLVR2 accuracy and consistency against a restatement of lil-lab/nlvr's metrics.py."""

from __future__ import annotations

import json
import random
import re

import pytest

from pipelines.scoring.inputs import ScoringInputError
from pipelines.scoring.nlvr2 import read_nlvr2_gold, read_nlvr2_predictions, score_nlvr2, score_nlvr2_files


def ref_metrics(gold: dict[str, bool], predicted: dict[str, bool]) -> tuple[float, float]:
    """Sentences grouped by (split, set id, sentence id) parsed with a regex; consistent = all pairs right."""
    groups: dict[tuple, list[bool]] = {}
    for ident, label in gold.items():
        split, set_id, _pair, sent = re.fullmatch(r"([a-z0-9]+)-(\d+)-(\d+)-(\d+)", ident).groups()
        groups.setdefault((split, set_id, sent), []).append(predicted[ident] == label)
    right = [ok for oks in groups.values() for ok in oks]
    return round(100 * sum(right) / len(right), 2), round(
        100 * sum(all(o) for o in groups.values()) / len(groups), 2
    )


def test_multi_pair_sentences_are_consistent_only_when_every_pair_is_right():
    gold = {"dev-1-0-0": True, "dev-1-1-0": False, "dev-1-2-0": True, "dev-1-0-1": True, "dev-2-0-0": False}
    predicted = {
        "dev-1-0-0": True,
        "dev-1-1-0": True,
        "dev-1-2-0": True,
        "dev-1-0-1": True,
        "dev-2-0-0": False,
    }
    got = score_nlvr2(predicted, gold)
    # sentence dev-1-?-0 has one wrong pair out of three; dev-1-?-1 and dev-2-?-0 are right
    assert got == {"accuracy": 80.0, "consistency": 66.67, "statements": 5, "sentences": 3}
    assert (got["accuracy"], got["consistency"]) == ref_metrics(gold, predicted)


def test_official_jsonl_and_lxmert_json_score_as_the_restatement(tmp_path):
    rng = random.Random(2)
    gold = {
        f"test1-{s}-{p}-{k}": rng.random() < 0.5
        for s in range(40)
        for k in range(2)
        for p in range(rng.randint(1, 4))
    }
    predicted = {i: (v if rng.random() < 0.8 else not v) for i, v in gold.items()}
    lines = [json.dumps({"identifier": i, "sentence": "s", "label": str(v)}) for i, v in gold.items()]
    (tmp_path / "test1.json").write_text("\n".join(lines) + "\n")
    (tmp_path / "lxmert.json").write_text(
        json.dumps(
            [
                {"identifier": i, "img0": "a", "img1": "b", "sent": "s", "label": int(v)}
                for i, v in gold.items()
            ]
        )
    )
    (tmp_path / "pred.csv").write_text(
        "".join(f"{i},{'true' if v else 'FALSE'}\n" for i, v in predicted.items())
    )

    want = ref_metrics(gold, predicted)
    for gold_file in ("test1.json", "lxmert.json"):
        got = score_nlvr2_files(tmp_path / "pred.csv", tmp_path / gold_file)
        assert (got["accuracy"], got["consistency"]) == want


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("dev-1-0-0,yes\n", r"line 1 \(dev-1-0-0\): prediction is 'yes', expected True or False"),
        ("dev-1-0-0\n", "line 1: expected 'identifier,True|False', got 1"),
        ("dev-1-0-0,True\n\ndev-1-0-0,False\n", "line 3: identifier 'dev-1-0-0' is predicted twice"),
    ],
)
def test_bad_prediction_csv_names_the_line(tmp_path, content, match):
    (tmp_path / "p.csv").write_text(content)
    with pytest.raises(ScoringInputError, match=match):
        read_nlvr2_predictions(tmp_path / "p.csv")


def test_bad_gold_and_missing_predictions_are_named(tmp_path):
    (tmp_path / "dev.json").write_text('{"identifier": "dev-1-0", "label": "True"}\n')
    with pytest.raises(ScoringInputError, match="'dev-1-0' is not split-setid-pairid-sentid"):
        read_nlvr2_gold(tmp_path / "dev.json")
    (tmp_path / "dev.json").write_text('{"identifier": "dev-1-0-0", "label": "maybe"}\n')
    with pytest.raises(ScoringInputError, match=r"dev.json line 1 \(dev-1-0-0\): label is 'maybe'"):
        read_nlvr2_gold(tmp_path / "dev.json")
    with pytest.raises(ScoringInputError, match="1 statements have no prediction"):
        score_nlvr2({}, {"dev-1-0-0": True})
