"""Community VQA/GQA/NLVR2 files, soft targets and collation with padded text and region sets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.data.answers import AnswerTable
from pipelines.data.nlvr2 import collate_nlvr2, load_nlvr2_examples
from pipelines.data.qa import collate_qa, load_qa_examples, soft_target
from pipelines.data.text import EncodedTexts


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
    with pytest.raises(ValueError, match=r"b.json: row 0 repeats question_id 1 \(first in .*a.json\)"):
        load_qa_examples([a, b])
    b.write_text(json.dumps([{"question_id": 3, "img_id": "y", "sent": "s", "label": {"red": "high"}}]))
    with pytest.raises(ValueError, match="b.json: row 0 label must map answers to scores"):
        load_qa_examples(b)
    b.write_text("[{]")
    with pytest.raises(ValueError, match="b.json: neither a JSON list"):
        load_qa_examples(b)


def test_nlvr2_json_lines_with_official_string_labels(tmp_path):
    path = tmp_path / "dev.json"
    rows = [
        {"identifier": "dev-1-0-0", "img0": "l", "img1": "r", "sent": "s", "label": "True"},
        {"identifier": "dev-1-1-0", "img0": "l2", "img1": "r2", "sent": "s", "label": 0},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [e.label for e in load_nlvr2_examples(path)] == [1, 0]
    path.write_text(json.dumps([{**rows[0], "label": 2}]))
    with pytest.raises(ValueError, match="row 0 label must be 0/1"):
        load_nlvr2_examples(path)


def test_soft_target_uses_the_table_and_drops_unknown_answers():
    table = AnswerTable(["2", "dog", "red"])
    target = soft_target({"two": 0.6, "the dog": 1.0, "cat": 0.3}, table)
    np.testing.assert_array_equal(target, np.array([0.6, 1.0, 0.0], np.float32))


class _Tok:
    """Whitespace tokenizer with BERT's [CLS]/[SEP] framing and truncation."""

    def __call__(self, sents, truncation, max_length):
        ids = [[101] + [len(w) for w in s.split()][: max_length - 2] + [102] for s in sents]
        return {"input_ids": ids}


def test_encoded_texts_round_trip_in_chunks():
    sents = ["a bb ccc", "dddd", "e f g h i j k"]
    texts = EncodedTexts(_Tok(), sents, max_length=5, chunk=2)
    assert [texts[i].tolist() for i in range(len(texts))] == [
        [101, 1, 2, 3, 102],
        [101, 4, 102],
        [101, 1, 1, 1, 102],
    ]
    assert texts[0].dtype == np.int64


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


def test_collate_nlvr2_keeps_each_pair_together():
    items = []
    for s in range(3):
        a, b = _item(2 + s, 1 + s, 4, 10 * s), _item(2, 3, 4, 10 * s + 1)
        items.append(
            {
                "id": f"i{s}",
                "input_ids": a["input_ids"],
                "feats": [a["feats"], b["feats"]],
                "boxes": [a["boxes"], b["boxes"]],
                "label": s % 2,
            }
        )
    batch = collate_nlvr2(items)
    assert batch["visual_feats"].shape == (3, 2, 3, 4)
    assert batch["visual_attention_mask"][:, 0].sum(dim=1).tolist() == [1, 2, 3]
    assert batch["visual_attention_mask"][:, 1].sum(dim=1).tolist() == [3, 3, 3]
    assert torch.equal(batch["visual_feats"][2, 1], torch.from_numpy(items[2]["feats"][1]))
    assert batch["labels"].tolist() == [0, 1, 0]
