"""NLVR2 rows (JSON lines, string labels) and pair collation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.data.example_batch import ExampleBatch
from pipelines.data.nlvr2 import collate_nlvr2, load_nlvr2_examples
from pipelines.data.regions import pad_regions


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


def _statement(s: int) -> ExampleBatch:
    """Statement s alone: s + 2 tokens; its left image s + 1 regions, its right one 3, features of 4 dims."""
    rng = np.random.default_rng(s)
    feats = [rng.random((n, 4), dtype=np.float32) for n in (1 + s, 3)]
    boxes = [rng.random((n, 4), dtype=np.float32) for n in (1 + s, 3)]
    return ExampleBatch(
        ids=[f"i{s}"],
        images=[f"l{s}", f"r{s}"],
        regions=pad_regions(feats, boxes),
        token_ids=np.arange(1, s + 3, dtype=np.int64)[None, :],
        lengths=np.array([s + 2]),
        labels=np.array([s % 2]),
    )


def test_collate_nlvr2_keeps_each_pair_together():
    items = [_statement(s) for s in range(3)]
    batch = collate_nlvr2(items)
    assert batch["visual_feats"].shape == (3, 2, 3, 4)
    assert batch["visual_attention_mask"][:, 0].sum(dim=1).tolist() == [1, 2, 3]
    assert batch["visual_attention_mask"][:, 1].sum(dim=1).tolist() == [3, 3, 3]
    assert torch.equal(batch["visual_feats"][2, 1], torch.from_numpy(items[2].regions.feats[1]))
    assert batch["attention_mask"].sum(dim=1).tolist() == [2, 3, 4]
    assert batch["labels"].tolist() == [0, 1, 0] and batch["ids"] == ["i0", "i1", "i2"]
