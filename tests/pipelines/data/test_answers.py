"""Answer normalisation (the release's rules) and the answer table's build / load / save."""

from __future__ import annotations

import json

import pytest

from pipelines.data.answers import AnswerTable, normalize_answer


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Yes", "yes"),
        ("two.", "2"),
        ("The Man", "man"),
        ("a dog", "dog"),
        ("an apple.", "apple"),
        ("ten", "10"),
        ("Grey", "gray"),
        ("twenty", "twenty"),
        ("theater", "theater"),
        ("another one", "another one"),
        ("", ""),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_build_counts_normalised_answers_with_min_count():
    labels = [{"Two": 1.0}, {"2": 0.3, "dog": 1.0}, {"the dog": 0.6}, {"cat": 1.0}, {"a dog.": 0.9}]
    table = AnswerTable.build(labels, min_count=2)
    assert table.answers == ["dog", "2"]  # dog x3, 2 x2, cat x1 dropped
    assert table.index("The Dog") == 0 and "two" in table and "cat" not in table
    assert table.get("cat") is None
    assert table.labels({"two": 0.3, "2": 0.9, "cat": 1.0}) == {1: 0.9}
    assert AnswerTable.build(labels, min_count=1, max_size=1).answers == ["dog"]


def test_load_both_forms_and_save_round_trip(tmp_path):
    d = tmp_path / "trainval_ans2label.json"
    d.write_text(json.dumps({"yes": 1, "no": 0, "2": 2}))
    table = AnswerTable.load(d)
    assert table.answers == ["no", "yes", "2"]
    lst = tmp_path / "label2ans.json"
    lst.write_text(json.dumps(["no", "yes", "2"]))
    assert AnswerTable.load(lst) == table
    out = tmp_path / "saved.json"
    table.save(out)
    assert json.loads(out.read_text()) == {"no": 0, "yes": 1, "2": 2}
    assert AnswerTable.load(out) == table


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"a": 0, "b": 5}', "indices"),
        ('{"a": "x"}', "ans2label"),
        ("[1, 2", "not valid JSON"),
        ('["a", "a"]', "twice"),
    ],
)
def test_bad_tables_are_refused(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        AnswerTable.load(path)


def test_release_all_ans_json_loads_in_its_order(tmp_path):
    path = tmp_path / "all_ans.json"
    rows = [
        {"ans": "yes", "dsets": ["vqa", "gqa"]},
        {"ans": "no", "dsets": ["vqa"]},
        {"ans": "2", "dsets": []},
    ]
    path.write_text(json.dumps(rows))
    table = AnswerTable.load(path)
    assert table.answers == ["yes", "no", "2"] and table.index("Two") == 2
    path.write_text(json.dumps([{"ans": "yes"}, {"answer": "no"}]))
    with pytest.raises(ValueError, match=r"all_ans.json: entry 1 has no string 'ans'"):
        AnswerTable.load(path)
    path.write_text(json.dumps([{"ans": "yes"}, {"ans": "yes"}]))
    with pytest.raises(ValueError, match=r"all_ans.json: .*twice"):
        AnswerTable.load(path)
    with pytest.raises(ValueError, match="answer table .* not found"):
        AnswerTable.load(tmp_path / "absent.json")


def test_loaded_keys_match_whether_or_not_either_side_is_normalised(tmp_path):
    path = tmp_path / "ans2label.json"
    path.write_text(json.dumps({"Two": 0, "the dog": 1, "grey": 2, "2 dogs": 3, "The Cat": 4, "THE CAT": 5}))
    table = AnswerTable.load(path)
    assert table.answers == ["Two", "the dog", "grey", "2 dogs", "The Cat", "THE CAT"]  # rows kept as filed
    # as given first, then normalised against the keys as given, then against the keys normalised
    assert [table.get(a) for a in ("Two", "two", "2", "2.", "the dog", "A dog", "dog")] == [
        0,
        0,
        0,
        0,
        1,
        1,
        1,
    ]
    assert table.index("gray") == 2 and table.index("Grey") == 2 and "2 dogs" in table
    assert table.index("THE CAT") == 5 and table.index("cat") == 4  # alike once normalised: the first row
    assert table.labels({"2": 0.6, "dog": 1.0, "two": 0.9, "horse": 1.0}) == {0: 0.9, 1: 1.0}
    table.save(tmp_path / "saved.json")
    assert AnswerTable.load(tmp_path / "saved.json").answers == table.answers
    built = AnswerTable.build([{"Two": 1.0}, {"the dog": 1.0}])  # built tables hold normalised answers
    assert built.answers == ["2", "dog"] and built.index("two") == 0
