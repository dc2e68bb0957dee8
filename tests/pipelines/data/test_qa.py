"""Community VQA/GQA files, soft targets and collation with padded text and region sets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.data.answers import AnswerTable
from pipelines.data.qa import QABatch, collate_qa, load_qa_examples, soft_target
from pipelines.data.regions import PaddedRegions


def test_qa_rows_load_from_several_files(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(
        json.dumps(
            [{"question_id": 1, "img_id": "x", "sent": "q?", "label": {"red": 1}, "answer_type": "other"}]
        )
    )
    b.write_text(json.dumps([{"question_id": "g2", "img_id": "y", "sent": "q2?"}]))
    ex = load_qa_examples([a, b])
    assert [(e.question_id, e.img_id, e.label, e.answer_type) for e in ex] == [
        (1, "x", {"red": 1.0}, "other"),
        ("g2", "y", None, None),
    ]
    b.write_text(json.dumps([{"question_id": 1, "img_id": "y", "sent": "again"}]))
    with pytest.raises(
        ValueError, match=r"b.json: row 1 \(line 1\): question_id 1 repeats \(first in .*a.json\)"
    ):
        load_qa_examples([a, b])
    b.write_text(json.dumps([{"question_id": 3, "img_id": "y", "sent": "s", "label": {"red": "high"}}]))
    with pytest.raises(ValueError, match=r"b.json: row 1 \(line 1\): 'label' must map answers to scores"):
        load_qa_examples(b)
    b.write_text("[{]")
    with pytest.raises(ValueError, match="b.json: line 1: not valid JSON"):
        load_qa_examples(b)


def test_soft_target_uses_the_table_and_drops_unknown_answers():
    table = AnswerTable(["2", "dog", "red"])
    target = soft_target({"two": 0.6, "the dog": 1.0, "cat": 0.3}, table)
    np.testing.assert_array_equal(target, np.array([0.6, 1.0, 0.0], np.float32))


def _batch(n_tokens: list[int], n_boxes: list[int], dim: int, labelled: bool = True) -> QABatch:
    rng = np.random.default_rng(0)
    b, length, slots = len(n_tokens), max(n_tokens), max(n_boxes)
    ids = np.zeros((b, length), np.int64)
    feats = np.zeros((b, slots, dim), np.float16)
    valid = np.zeros((b, slots), bool)
    for k, (t, m) in enumerate(zip(n_tokens, n_boxes, strict=True)):
        ids[k, :t] = np.arange(1, t + 1)
        feats[k, :m] = rng.random((m, dim))
        valid[k, :m] = True
    targets = np.repeat(np.arange(b, dtype=np.float32)[:, None], 3, axis=1) if labelled else None
    return QABatch(
        list(range(b)),
        ids,
        np.array(n_tokens),
        PaddedRegions(feats, np.zeros((b, slots, 4), np.float32), valid),
        targets,
    )


def test_collate_qa_pads_text_and_regions_with_masks():
    one = _batch([3], [2], 5)
    b = collate_qa([one, _batch([5], [4], 5)], pad_id=0)  # single questions, joined
    assert b["input_ids"].tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert b["visual_feats"].shape == (2, 4, 5) and b["visual_pos"].shape == (2, 4, 4)
    assert b["visual_feats"].dtype == torch.float16, "features stay as stored until the device"
    assert b["visual_attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert torch.equal(b["visual_feats"][0, :2], torch.from_numpy(one.regions.feats[0, :2]))
    assert b["visual_feats"][0, 2:].abs().sum() == 0
    assert b["labels"].tolist() == [[0, 0, 0], [0, 0, 0]] and b["ids"] == [0, 0]
    assert collate_qa(_batch([3, 5], [2, 4], 5))["labels"].tolist() == [[0, 0, 0], [1, 1, 1]]
    unlabelled = collate_qa([one, _batch([2], [1], 5, labelled=False)])
    assert "labels" not in unlabelled


def test_an_empty_answer_among_answered_rows_is_named(tmp_path):
    """Issue 45: an empty answer cell is a mistake to name, with the file's other problems; a file with no
    answers at all is an unlabelled (test) file."""
    rows = tmp_path / "q.csv"
    rows.write_text("image,question,answer\na.jpg,what?,red\nb.jpg,,red\nc.jpg,what?,\n")
    with pytest.raises(ValueError) as err:
        load_qa_examples(rows)
    assert "line 3: no 'question'; line 4: the answer is empty" in str(err.value)
    unlabelled = tmp_path / "test.csv"
    unlabelled.write_text("image,question,answer\na.jpg,what?,\n")
    assert load_qa_examples(unlabelled)[0].label is None
