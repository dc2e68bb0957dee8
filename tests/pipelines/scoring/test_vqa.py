"""VQA scoring against independent restatements of the official vqaEval.py rules, 2017 and 2021."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from pipelines.scoring.inputs import ScoringInputError
from pipelines.scoring.vqa import (
    VQAGold,
    normalize_prediction,
    question_accuracy,
    read_vqa_gold,
    read_vqa_predictions,
    score_vqa,
    score_vqa_files,
)

# --- an independent restatement: character scans instead of str.replace/regex, subsets enumerated ---
REF_PUNCT = set(';/[]"{}()=+\\_-><@`,?!')
REF_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5"}
REF_NUMBERS |= {"six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
REF_CONTRACTIONS = {"dont": "don't", "isnt": "isn't", "whats": "what's", "cant": "can't"}
DIGITS = "0123456789"


def ref_punctuation(s: str) -> str:
    digit_comma_digit = any(
        s[i] in DIGITS and s[i + 1] == "," and s[i + 2] in DIGITS for i in range(len(s) - 2)
    )
    chars = []
    for c in s:
        if c in REF_PUNCT:
            if not (digit_comma_digit or f"{c} " in s or f" {c}" in s):
                chars.append(" ")
        else:
            chars.append(c)
    out, dropped = [], 0
    for i, c in enumerate(chars):
        followed_by_digit = i + 1 < len(chars) and chars[i + 1] in DIGITS
        if c == "." and not followed_by_digit and dropped < 32:
            dropped += 1
            continue
        out.append(c)
    return "".join(out)


def ref_prediction(s: str) -> str:
    words = ref_punctuation(s.replace("\n", " ").replace("\t", " ").strip()).lower().split()
    words = [REF_NUMBERS.get(w, w) for w in words]
    return " ".join(REF_CONTRACTIONS.get(w, w) for w in words if w not in ("a", "an", "the"))


def ref_accuracy(prediction: str, humans: list[str]) -> float:
    """vqaEval.py as of 2017."""
    pred = ref_prediction(prediction)
    if len(set(humans)) != 1:
        humans = [ref_punctuation(h) for h in humans]
    return _leave_one_out(pred, humans)


def ref_accuracy_2021(prediction: str, humans: list[str]) -> float:
    """vqaEval.py as of 2021: everything stripped; normalised alike, or not at all when unanimous."""

    def clean(s: str) -> str:
        return s.replace("\n", " ").replace("\t", " ").strip()

    def full(s: str) -> str:
        words = [REF_NUMBERS.get(w, w) for w in ref_punctuation(s).lower().split()]
        return " ".join(REF_CONTRACTIONS.get(w, w) for w in words if w not in ("a", "an", "the"))

    pred, humans = clean(prediction), [clean(h) for h in humans]
    if len(set(humans)) != 1:
        pred, humans = full(pred), [full(h) for h in humans]
    return _leave_one_out(pred, humans)


def _leave_one_out(pred: str, humans: list[str]) -> float:
    subsets = list(itertools.combinations(range(len(humans)), len(humans) - 1))
    return sum(min(1.0, sum(humans[i] == pred for i in subset) / 3) for subset in subsets) / len(subsets)


# (prediction, the 10 human answers, accuracy worked out by hand)
TRICKY = [
    ("yes.", ["yes"] * 10, 1.0),  # the prediction is always normalised
    ("Yes", ["yes"] * 10, 1.0),
    ("yes", ["Yes"] * 5 + ["yes"] * 5, 1.0),  # human answers are never lowercased
    ("yes", ["Yes"] * 10, 0.0),
    ("yes", ["yes."] * 10, 0.0),  # all identical: the humans are left as they are
    ("yes", ["yes."] * 9 + ["no"], 1.0),  # not all identical: their punctuation is processed
    ("two", ["2"] * 3 + ["3"] * 7, 0.9),  # held-out 2s: 2/3 each, others 1
    ("2", ["two"] * 4 + ["2"] * 6, 1.0),
    ("two", ["two"] * 4 + ["2"] * 6, 1.0),  # "two" -> "2" matches the six 2s
    ("the man", ["man"] * 10, 1.0),
    ("a man", ["the man"] * 2 + ["man"] * 8, 1.0),
    ("dont", ["don't"] * 10, 1.0),
    ("1,000", ["1000"] * 10, 1.0),  # a digit,digit group: punctuation removed, not spaced
    ("1,000", ["1,000"] * 2 + ["1000"] * 8, 1.0),
    ("3.5", ["3.5"] * 10, 1.0),  # a period before a digit stays
    ("3.5", ["35"] * 10, 0.0),
    ("hot-dog", ["hot dog"] * 10, 1.0),
    ("hot - dog", ["hot - dog"] * 1 + ["hot dog"] * 9, 1.0),
    ("grey", ["gray"] * 10, 0.0),
    ("red", ["red"] * 1 + ["blue"] * 9, 0.3),  # one match: 0 when held out, 1/3 otherwise
    ("red", ["red"] * 2 + ["blue"] * 8, 0.6),
    ("What's up?", ["whats up"] * 10, 0.0),  # humans are not contraction-restored
]


# the same kind of cases under the 2021 script, worked out by hand
TRICKY_2021 = [
    ("yes.", ["yes"] * 10, 0.0),  # unanimous: nothing is normalised, not even the prediction
    ("Yes", ["yes"] * 10, 0.0),
    ("yes", ["Yes"] * 5 + ["yes"] * 5, 1.0),  # disagreeing humans are lowercased too
    ("yes", ["Yes"] * 10, 0.0),
    (" yes ", ["yes "] * 10, 1.0),  # but everything is stripped
    ("yes", ["yes."] * 9 + ["no"], 1.0),
    ("two", ["2"] * 3 + ["3"] * 7, 0.9),
    ("2", ["two"] * 4 + ["2"] * 6, 1.0),  # the humans' "two" becomes 2 as well
    ("two", ["two"] * 10, 1.0),
    ("2", ["two"] * 10, 0.0),  # unanimous "two" stays a word
    ("the man", ["man"] * 10, 0.0),  # unanimous: the article stays
    ("the man", ["man"] * 9 + ["a man"], 1.0),  # disagreeing: articles dropped on both sides
    ("What's up?", ["whats up"] * 9 + ["no"], 1.0),  # the humans' contractions are restored
    ("red", ["red"] * 2 + ["blue"] * 8, 0.6),
]


@pytest.mark.parametrize(("prediction", "humans", "expected"), TRICKY)
def test_tricky_answers_match_the_hand_values_and_the_restatement(prediction, humans, expected):
    assert question_accuracy(prediction, humans, "2017") == pytest.approx(expected)
    assert question_accuracy(prediction, humans, "2017") == pytest.approx(ref_accuracy(prediction, humans))


@pytest.mark.parametrize(("prediction", "humans", "expected"), TRICKY_2021)
def test_2021_tricky_answers_match_the_hand_values_and_the_restatement(prediction, humans, expected):
    assert question_accuracy(prediction, humans, "2021") == pytest.approx(expected)
    assert question_accuracy(prediction, humans) == pytest.approx(ref_accuracy_2021(prediction, humans))


def test_the_versions_disagree_where_the_fix_changed_the_rules():
    # every case above that the 2017 script scores differently, and the default is the current script
    separating = [(p, h) for p, h, _ in TRICKY_2021 if ref_accuracy(p, h) != ref_accuracy_2021(p, h)]
    assert len(separating) >= 6
    for prediction, humans in separating:
        assert question_accuracy(prediction, humans, "2017") != question_accuracy(prediction, humans, "2021")
        assert question_accuracy(prediction, humans) == question_accuracy(prediction, humans, "2021")
    with pytest.raises(ValueError, match="unknown VQA evaluator '2019'"):
        question_accuracy("yes", ["yes"] * 10, "2019")


@pytest.mark.parametrize(
    "text",
    [
        "yes.",
        "Two",
        "the man",
        "dont",
        "1,000",
        "2.5",
        "a.b",
        "hi - there",
        "x,y",
        " (red) ",
        "isnt it?",
        "one\tman",
    ],
)
def test_prediction_normalisation_agrees_with_the_restatement(text):
    assert normalize_prediction(text) == ref_prediction(text)


def test_more_than_32_periods_keep_the_rest():
    text = "a." * 40
    assert normalize_prediction(text).count(".") == 8 == ref_prediction(text).count(".")


def _official_files(tmp_path, questions):
    annotations = {
        "annotations": [
            {
                "question_id": qid,
                "image_id": 1,
                "question_type": qtype,
                "answer_type": atype,
                "answers": [
                    {"answer": a, "answer_confidence": "yes", "answer_id": i + 1}
                    for i, a in enumerate(humans)
                ],
            }
            for qid, (humans, atype, qtype) in questions.items()
        ]
    }
    qs = {"questions": [{"question_id": qid, "image_id": 1, "question": "?"} for qid in questions]}
    (tmp_path / "ann.json").write_text(json.dumps(annotations))
    (tmp_path / "q.json").write_text(json.dumps(qs))
    return tmp_path / "ann.json", tmp_path / "q.json"


@pytest.mark.parametrize(("evaluator", "ref"), [("2017", ref_accuracy), ("2021", ref_accuracy_2021)])
def test_random_files_score_as_the_restatement_overall_and_per_type(tmp_path, evaluator, ref):
    rng = random.Random(0)
    vocab = [
        "yes",
        "Yes",
        "yes.",
        "no",
        "2",
        "two",
        "the man",
        "man",
        "don't",
        "dont",
        "1,000",
        "1000",
        "gray",
        "grey",
        " yes",
        "a man",
        "Two",
        "whats up",
    ]
    questions, predictions = {}, []
    for qid in range(300):
        humans = (
            [rng.choice(vocab[:6])] * 10 if rng.random() < 0.3 else [rng.choice(vocab) for _ in range(10)]
        )
        questions[qid * 7] = (
            humans,
            rng.choice(["yes/no", "number", "other"]),
            rng.choice(["is the", "how many"]),
        )
        predictions.append({"question_id": qid * 7, "answer": rng.choice(vocab)})
    ann, qs = _official_files(tmp_path, questions)
    (tmp_path / "res.json").write_text(json.dumps(predictions))

    got = score_vqa_files(tmp_path / "res.json", ann, qs, evaluator=evaluator)

    answer = {p["question_id"]: p["answer"] for p in predictions}
    acc = {qid: ref(answer[qid], humans) for qid, (humans, _, _) in questions.items()}

    def pct(ids):
        return round(100 * sum(acc[i] for i in ids) / len(ids), 2)

    assert got["method"] == "official" and got["questions"] == 300
    assert got["evaluator"] == f"vqaEval.py {evaluator}"
    assert got["accuracy"] == pct(list(acc))
    for atype in ("yes/no", "number", "other"):
        assert got["per_answer_type"][atype] == pct([q for q, v in questions.items() if v[1] == atype])
    for qtype in ("is the", "how many"):
        assert got["per_question_type"][qtype] == pct([q for q, v in questions.items() if v[2] == qtype])


def test_lxmert_rows_score_the_normalised_prediction_with_its_label(tmp_path):
    rows = [
        {
            "question_id": 1,
            "img_id": "a",
            "sent": "?",
            "label": {"yes": 1.0},
            "answer_type": "yes/no",
            "question_type": "is",
        },
        {
            "question_id": 2,
            "img_id": "a",
            "sent": "?",
            "label": {"2": 0.6, "3": 1.0},
            "answer_type": "number",
            "question_type": "how",
        },
        {
            "question_id": 3,
            "img_id": "a",
            "sent": "?",
            "label": {},
            "answer_type": "other",
            "question_type": "what",
        },
    ]
    (tmp_path / "minival.json").write_text(json.dumps(rows))
    gold = read_vqa_gold(tmp_path / "minival.json")
    got = score_vqa({1: "Yes.", 2: "two", 3: "anything"}, gold)
    assert got["method"] == "lxmert-soft-labels" and "evaluator" not in got
    assert got["accuracy"] == round(100 * (1.0 + 0.6 + 0.0) / 3, 2)
    assert got["per_answer_type"] == {"yes/no": 100.0, "number": 60.0, "other": 0.0}


def test_missing_and_extra_predictions_are_refused():
    gold = {1: VQAGold(1, answers=("yes",) * 10), 2: VQAGold(2, answers=("no",) * 10)}
    with pytest.raises(ScoringInputError, match="1 questions .*no prediction.*2"):
        score_vqa({1: "yes"}, gold)
    with pytest.raises(ScoringInputError, match="not in"):
        score_vqa({1: "yes", 2: "no", 3: "x"}, gold)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('[{"question_id": "5", "answer": "yes"}]', r"row 0: 'question_id' is '5', not an integer"),
        ('[{"question_id": 5}]', r"row 0 \(question 5\): no 'answer' field"),
        (
            '[{"question_id": 5, "answer": "a"}, {"question_id": 5, "answer": "b"}]',
            "row 1: question 5 is predicted twice",
        ),
        ('{"question_id": 5}', "expected a JSON list"),
        ('[{"question_id": 5, "answer": "a"},', "not valid JSON \\(.* at line 1"),
    ],
)
def test_bad_prediction_files_name_the_file_and_row(tmp_path, content, match):
    path = tmp_path / "res.json"
    path.write_text(content)
    with pytest.raises(ScoringInputError, match=match) as info:
        read_vqa_predictions(path)
    assert str(path) in str(info.value)


def test_questions_file_given_as_gold_and_mismatched_questions_are_named(tmp_path):
    ann, qs = _official_files(tmp_path, {1: (["yes"] * 10, "yes/no", "is")})
    with pytest.raises(ScoringInputError, match="this is a questions file"):
        read_vqa_gold(qs)
    (tmp_path / "other_q.json").write_text(json.dumps({"questions": [{"question_id": 9}]}))
    with pytest.raises(ScoringInputError, match="same split"):
        read_vqa_gold(ann, tmp_path / "other_q.json")
