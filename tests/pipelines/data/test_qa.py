"""Community VQA/GQA files, soft targets and collation with padded text and region sets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.data.answers import AnswerTable
from pipelines.data.qa import collate_qa, load_qa_examples, soft_target


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


def _item(n_tokens: int, n_boxes: int, dim: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "id": seed,
        "input_ids": np.arange(1, n_tokens + 1, dtype=np.int64),
        "feats": rng.random((n_boxes, dim), dtype=np.float32),
        "boxes": rng.random((n_boxes, 4), dtype=np.float32),
        "target": np.full(3, seed, np.float32),
    }


def test_collate_qa_pads_text_and_regions_with_masks():
    items = [_item(3, 2, 5, 0), _item(5, 4, 5, 1)]
    b = collate_qa(items, pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert b["visual_feats"].shape == (2, 4, 5) and b["visual_pos"].shape == (2, 4, 4)
    assert b["visual_attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert torch.equal(b["visual_feats"][0, :2], torch.from_numpy(items[0]["feats"]))
    assert b["visual_feats"][0, 2:].abs().sum() == 0
    assert b["labels"].tolist() == [[0, 0, 0], [1, 1, 1]] and b["ids"] == [0, 1]
    unlabelled = collate_qa([{k: v for k, v in it.items() if k != "target"} for it in items])
    assert "labels" not in unlabelled
