"""NLVR2 rows (JSON lines, string labels) and pair collation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.data.nlvr2 import collate_nlvr2, load_nlvr2_examples


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


def _item(n_tokens: int, n_boxes: int, dim: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "id": seed,
        "input_ids": np.arange(1, n_tokens + 1, dtype=np.int64),
        "feats": rng.random((n_boxes, dim), dtype=np.float32),
        "boxes": rng.random((n_boxes, 4), dtype=np.float32),
        "target": np.full(3, seed, np.float32),
    }


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
