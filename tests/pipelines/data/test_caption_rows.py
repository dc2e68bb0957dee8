"""Images to caption as memory-mapped columns: the object path's examples and batches for Karpathy, COCO
and row files; the cache reused or rebuilt; a mapped dataset pickled as its folder."""

from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pytest

import pipelines.data.captions as captions_mod
from pipelines.data.captions import (
    CaptionDataset,
    Vocabulary,
    collate_captions,
    load_caption_examples,
    load_caption_rows,
    tokenize_caption,
)
from pipelines.data.columns import Mapped
from pipelines.data.regions import normalized_boxes
from storage import FeatureReader
from tests.pipelines.data.test_qa_rows import DIM, IMAGES, store  # noqa: F401  (a fixture)

WORDS = ["a", "dog", "red", "cat", "sat", "on", "the", "mat", "Über", "runs"]


def _captions(rng, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 8)))) + "." for _ in range(n)]


def _write(root, images: int = 11, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    splits = ["train", "restval", "val", "test"]
    karpathy = {
        "images": [
            {
                "filepath": "",
                "filename": f"im{k}",
                "split": splits[k % 4],
                "cocoid": 100 + k,
                "sentences": [{"tokens": tokenize_caption(s), "raw": s} for s in _captions(rng, 1 + k % 5)],
            }
            for k in range(images)
        ]
    }
    coco = {
        "images": [{"id": k, "file_name": f"im{k}"} for k in range(images)],
        "annotations": [{"image_id": k % images, "caption": c} for k, c in enumerate(_captions(rng, 30))],
    }
    lines = ["image,caption"] + [f"im{k % images},{c}" for k, c in enumerate(_captions(rng, 25))]
    files = {"karpathy": root / "dataset_coco.json", "coco": root / "captions_train2014.json"}
    files["rows"] = root / "captions.csv"
    files["karpathy"].write_text(json.dumps(karpathy))
    files["coco"].write_text(json.dumps(coco))
    files["rows"].write_text("\n".join(lines) + "\n")
    return files


def _reference(examples, indices, reader, vocab, max_length, seed) -> dict:
    rng = np.random.default_rng(seed)
    chosen = [
        vocab.encode(c[int(rng.integers(len(c)))], max_length) for c in (examples[i].label for i in indices)
    ]
    padded = np.zeros((len(chosen), max(map(len, chosen))), np.int64)
    for k, c in enumerate(chosen):
        padded[k, : len(c)] = c
    recs = [reader[examples[i].img_id] for i in indices]
    slots = max(r.num_boxes for r in recs)
    feats = np.zeros((len(recs), slots, DIM), np.float32)
    pos = np.zeros((len(recs), slots, 4), np.float32)
    for k, r in enumerate(recs):
        feats[k, : r.num_boxes], pos[k, : r.num_boxes] = r.features, normalized_boxes(r)
    return {
        "input_ids": padded[:, :-1],
        "labels": padded[:, 1:],
        "visual_feats": feats,
        "visual_pos": pos,
        "ids": [examples[i].image_id for i in indices],
    }


def _assert_batch(got: dict, want: dict) -> None:
    for key in ("input_ids", "labels", "visual_pos"):
        np.testing.assert_array_equal(got[key].numpy(), want[key], err_msg=key)
    np.testing.assert_array_equal(got["visual_feats"].float().numpy(), want["visual_feats"])
    assert got["ids"] == want["ids"] and [type(i) for i in got["ids"]] == [type(i) for i in want["ids"]]


@pytest.mark.parametrize(
    ("kind", "split"), [("karpathy", "train"), ("karpathy", "val"), ("coco", "train"), ("rows", "train")]
)
@pytest.mark.parametrize("cached", [False, True])
def test_rows_give_the_object_paths_examples_and_batches(store, tmp_path, kind, split, cached):  # noqa: F811
    path, _ = store
    reader = FeatureReader(path)
    spec = _write(tmp_path)[kind]
    cache = tmp_path / "cache" if cached else None
    examples = load_caption_examples([spec], split)
    rows = load_caption_rows([spec], split, cache)
    assert isinstance(rows.columns["refs"], Mapped) == cached
    assert list(rows) == examples
    vocab = Vocabulary(["a", "dog", "red", "cat", "über"])
    for data, own in (
        (CaptionDataset(rows, reader, vocab, 4, cache), examples),
        (CaptionDataset(examples, reader, vocab, 4), examples),
        (CaptionDataset(rows.select(np.arange(len(rows)) % 3 != 0), reader, vocab, 4, cache), None),
    ):
        own = own or [e for i, e in enumerate(examples) if i % 3 != 0]
        indices = [len(own) - 1, 0, len(own) // 2, 0]
        got = collate_captions(data.__getitems__(indices), np.random.default_rng(5), vocab.pad_id)
        _assert_batch(got, _reference(own, indices, reader, vocab, 4, 5))


def test_cache_reused_rebuilt_when_damaged_and_pickled_small(store, tmp_path, monkeypatch, caplog):  # noqa: F811
    path, _ = store
    spec = _write(tmp_path)["coco"]
    cache = tmp_path / "cache"
    first = load_caption_rows([spec], "train", cache)
    with monkeypatch.context() as m:
        m.setattr(captions_mod, "load_caption_examples", None)  # reading the file again would fail
        assert list(load_caption_rows([spec], "train", cache)) == list(first)
    assert load_caption_rows([spec], "val", cache).key != first.key  # another split, other columns
    vocab = Vocabulary(["a", "dog"])
    data = CaptionDataset(first, FeatureReader(path), vocab, 4, cache)
    in_memory = CaptionDataset(load_caption_rows([spec], "train"), FeatureReader(path), vocab, 4)
    assert isinstance(data.ids, Mapped) and 2 * len(pickle.dumps(data)) < len(pickle.dumps(in_memory))
    back = pickle.loads(pickle.dumps(data))
    want = collate_captions(data.__getitems__([3, 1]), None, vocab.pad_id)
    got = collate_captions(back.__getitems__([3, 1]), None, vocab.pad_id)
    assert got["ids"] == want["ids"] and got["input_ids"].equal(want["input_ids"])
    with open(first.directory / "refs.bin", "r+b") as fh:
        fh.truncate(10)
    with caplog.at_level(logging.WARNING):
        assert list(load_caption_rows([spec], "train", cache)) == load_caption_examples([spec], "train")
    assert "converting again" in caplog.text


def test_errors_are_those_of_the_object_path(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("image,caption\nim1,\n")
    with pytest.raises(ValueError) as want:
        load_caption_examples([bad])
    with pytest.raises(ValueError) as got:
        load_caption_rows([bad], None, tmp_path / "cache")
    assert str(got.value) == str(want.value)
    for call in (load_caption_examples, lambda *a: load_caption_rows(*a, cache_dir=tmp_path / "cache")):
        with pytest.raises(ValueError, match="no such file"):
            call([tmp_path / "absent.json"], None)
