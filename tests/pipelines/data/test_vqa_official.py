"""The official VQA questions + annotations pair loads as labelled training rows: images named as LXMERT
names them, the ten human answers as soft scores, the annotations found beside the questions file."""

from __future__ import annotations

import json

import pytest

from pipelines.data.qa import load_qa_examples
from pipelines.data.row_files import RowFileError

QUESTIONS = {
    "info": {},
    "task_type": "Open-Ended",
    "data_type": "mscoco",
    "license": {},
    "data_subtype": "val2014",
    "questions": [
        {"image_id": 42, "question": "How many dogs are there?", "question_id": 420},
        {"image_id": 7, "question": "What colour is the bus?", "question_id": 71},
    ],
}


def _answers(*texts):
    return [{"answer": t, "answer_confidence": "yes", "answer_id": i + 1} for i, t in enumerate(texts)]


ANNOTATIONS = {
    "info": {},
    "license": {},
    "data_subtype": "val2014",
    "annotations": [
        {
            "question_id": 420,
            "image_id": 42,
            "question_type": "how many",
            "answer_type": "number",
            "multiple_choice_answer": "2",
            "answers": _answers(*(["two"] * 3 + ["2"] * 6 + ["3"])),
        },
        {
            "question_id": 71,
            "image_id": 7,
            "question_type": "what color is the",
            "answer_type": "other",
            "multiple_choice_answer": "blue",
            "answers": _answers(*(["Blue"] * 8 + ["red", "red"])),
        },
    ],
}


def _write(folder, name, data):
    path = folder / name
    path.write_text(json.dumps(data))
    return path


def _score(count):  # LXMERT's get_score, written out independently of the loader
    return {0: 0.0, 1: 0.3, 2: 0.6, 3: 0.9}.get(count, 1.0)


def test_questions_and_annotations_given_together(tmp_path):
    q = _write(tmp_path, "my_questions.json", QUESTIONS)
    a = _write(tmp_path, "my_annotations.json", ANNOTATIONS)
    examples = {e.question_id: e for e in load_qa_examples([q, a])}
    assert sorted(examples) == [71, 420]
    dogs, bus = examples[420], examples[71]
    assert dogs.img_id == "COCO_val2014_000000000042"
    assert bus.img_id == "COCO_val2014_000000000007"
    assert dogs.sent == "How many dogs are there?"
    # "two" and "2" are one answer (the release's normalisation): 9 votes; "3" one vote
    assert dogs.label == {"2": _score(9), "3": _score(1)}
    assert bus.label == {"blue": _score(8), "red": _score(2)}
    assert (dogs.answer_type, dogs.question_type) == ("number", "how many")


def test_the_annotations_beside_the_questions_are_found_by_the_release_names(tmp_path):
    q = _write(tmp_path, "v2_OpenEnded_mscoco_val2014_questions.json", QUESTIONS)
    _write(tmp_path, "v2_mscoco_val2014_annotations.json", ANNOTATIONS)
    examples = load_qa_examples([q])
    assert all(e.label for e in examples)


def test_questions_alone_are_an_unlabelled_split(tmp_path):
    test = dict(QUESTIONS, data_subtype="test2015")
    examples = load_qa_examples([_write(tmp_path, "v2_OpenEnded_mscoco_test2015_questions.json", test)])
    assert [e.img_id for e in examples] == ["COCO_test2015_000000000042", "COCO_test2015_000000000007"]
    assert all(e.label is None for e in examples)


def test_annotations_without_questions_are_refused(tmp_path):
    a = _write(tmp_path, "v2_mscoco_val2014_annotations.json", ANNOTATIONS)
    with pytest.raises(RowFileError, match="annotations without their questions file"):
        load_qa_examples([a])


def test_annotations_of_another_split_are_refused(tmp_path):
    q = _write(tmp_path, "q.json", QUESTIONS)
    other = dict(
        ANNOTATIONS,
        annotations=[dict(x, question_id=x["question_id"] + 1) for x in ANNOTATIONS["annotations"]],
    )
    a = _write(tmp_path, "a.json", other)
    with pytest.raises(RowFileError, match="none of its questions is in"):
        load_qa_examples([q, a])


def test_a_malformed_official_question_is_named(tmp_path):
    bad = dict(QUESTIONS, questions=[{"image_id": 42, "question_id": 1}, {"image_id": 7, "question": "q?"}])
    with pytest.raises(RowFileError) as exc:
        load_qa_examples([_write(tmp_path, "q.json", bad)])
    assert "row 1: no 'question'" in str(exc.value)
