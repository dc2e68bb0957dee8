"""Retrieval data: row and Karpathy files, in-batch candidates, caption x image pairs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipelines.data.example_batch import ExampleBatch
from pipelines.data.regions import pad_regions
from pipelines.data.retrieval import (
    candidate_inputs,
    collate_candidates,
    collate_pairs,
    load_retrieval_examples,
    pair_key,
    split_pair_key,
)


def test_rows_and_karpathy_files(tmp_path):
    rows = tmp_path / "rows.json"
    rows.write_text(
        json.dumps([{"img_id": "a", "sentences": ["one", "two"]}, {"img_id": "b", "sentences": ["x"]}])
    )
    examples = load_retrieval_examples(rows)
    assert [(e.caption_id, e.img_id, e.sent, e.label) for e in examples] == [
        ("a#0", "a", "one", "a"),
        ("a#1", "a", "two", "a"),
        ("b#0", "b", "x", "b"),
    ]
    karpathy = tmp_path / "dataset_flickr30k.json"
    images = [
        {"filename": "1000092795.jpg", "split": "test", "sentences": [{"raw": "Two men.", "sentid": 0}]},
        {"filename": "10002456.jpg", "split": "train", "sentences": [{"raw": "A dog.", "sentid": 5}]},
    ]
    karpathy.write_text(json.dumps({"images": images, "dataset": "flickr30k"}))
    test = load_retrieval_examples(f"{karpathy}#test")
    assert [(e.caption_id, e.img_id, e.sent) for e in test] == [("1000092795#0", "1000092795", "Two men.")]
    assert len(load_retrieval_examples(karpathy)) == 2
    with pytest.raises(ValueError, match="appears twice"):
        load_retrieval_examples([rows, rows])
    with pytest.raises(ValueError, match="Karpathy"):
        load_retrieval_examples(f"{rows}#test")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"img_id": "a", "sentences": [3]}]))
    with pytest.raises(ValueError, match="row 0 sentence 0"):
        load_retrieval_examples(bad)


def _captions(imgs: list[str], rng: np.random.Generator, pair_with: str | None = None) -> ExampleBatch:
    """Caption k of image `iN` (paired with image `pair_with` when given): 2 or 3 regions whose features
    hold the image's number N."""
    feats = [np.full((2 + k % 2, 3), float(img[1:]), dtype=np.float32) for k, img in enumerate(imgs)]
    boxes = [rng.random((f.shape[0], 4)).astype(np.float32) for f in feats]
    ids = [f"{img}#{k}" for k, img in enumerate(imgs)]
    return ExampleBatch(
        ids=ids if pair_with is None else [pair_key(i, pair_with) for i in ids],
        images=imgs,
        regions=pad_regions(feats, boxes),
        token_ids=np.array([[2, 5 + k, 3] for k in range(len(imgs))]),
        lengths=np.full(len(imgs), 3),
        labels=None if pair_with is None else np.zeros(len(imgs), dtype=np.int64),
    )


def test_candidates_hold_the_own_image_once_at_the_label():
    rng = np.random.default_rng(0)
    items = _captions(["i0", "i1", "i1", "i2", "i3", "i4"], rng)
    batch = candidate_inputs(collate_candidates(items, 0, np.random.default_rng(1)))
    assert batch["visual_feats"].shape[:2] == (6, 4) and batch["labels"].shape == (6,)
    for k, img in enumerate(items.images):
        shown = batch["visual_feats"][k, :, 0, 0].numpy()  # each image's features hold its number
        own = float(img[1:])
        assert shown[int(batch["labels"][k])] == own and (shown == own).sum() == 1
        assert len(set(shown.tolist())) == 4
    with pytest.raises(ValueError, match="at least two images"):
        collate_candidates(_captions(["i0", "i0"], rng), 0, rng)


def test_pairs_keep_their_keys():
    rng = np.random.default_rng(0)
    batch = collate_pairs(_captions(["i0", "i1"], rng, pair_with="i9"))
    assert [split_pair_key(k) for k in batch["ids"]] == [("i0#0", "i9"), ("i1#1", "i9")]
    assert batch["labels"].tolist() == [0, 0] and batch["visual_feats"].shape == (2, 3, 3)
