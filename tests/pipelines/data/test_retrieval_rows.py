"""Retrieval captions as memory-mapped columns: the object path's examples, training batches and
evaluation pairs, from row files and Karpathy's split file; the cache reused; errors unchanged."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

import pipelines.data.retrieval as retrieval_mod
from pipelines.data.columns import Mapped
from pipelines.data.regions import normalized_boxes
from pipelines.data.retrieval import (
    CaptionDataset,
    PairDataset,
    collate_pairs,
    load_retrieval_examples,
    load_retrieval_rows,
    pair_key,
)
from storage import FeatureReader
from tests.pipelines.data.test_qa_rows import DIM, IMAGES, WORDS, store  # noqa: F401  (a fixture)


def _sentences(rng, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 12)))) for _ in range(n)]


def _write(root, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    rows = [{"img_id": f"im{k}", "sentences": _sentences(rng, 1 + k % 3)} for k in range(IMAGES - 1)]
    karpathy = {
        "images": [
            {
                "filename": f"im{k}.jpg",
                "split": ["train", "restval", "test"][k % 3],
                "sentences": [{"raw": s, "sentid": 10 * k + j} for j, s in enumerate(_sentences(rng, 2))],
            }
            for k in range(IMAGES - 1)
        ]
    }
    files = {"rows": root / "captions.json", "karpathy": root / "dataset_coco.json"}
    files["rows"].write_text(json.dumps(rows))
    files["karpathy"].write_text(json.dumps(karpathy))
    return files


def _visual(reader, imgs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    recs = [reader[i] for i in imgs]
    slots = max(r.num_boxes for r in recs)
    feats = np.zeros((len(recs), slots, DIM), np.float32)
    pos = np.zeros((len(recs), slots, 4), np.float32)
    for k, r in enumerate(recs):
        feats[k, : r.num_boxes], pos[k, : r.num_boxes] = r.features, normalized_boxes(r)
    return feats, pos


def _tokens(tokenizer, sents: list[str], max_length: int) -> np.ndarray:
    ids = [tokenizer(s, truncation=True, max_length=max_length)["input_ids"] for s in sents]
    out = np.zeros((len(ids), max(map(len, ids))), np.int64)
    for k, t in enumerate(ids):
        out[k, : len(t)] = t
    return out


@pytest.mark.parametrize("spec", ["rows", "karpathy", "karpathy#train,restval"])
@pytest.mark.parametrize("cached", [False, True])
def test_rows_give_the_object_paths_examples_and_batches(store, tmp_path, spec, cached):  # noqa: F811
    path, tokenizer = store
    reader = FeatureReader(path)
    kind, _, splits = spec.partition("#")
    given = str(_write(tmp_path)[kind]) + (f"#{splits}" if splits else "")
    cache = tmp_path / "cache" if cached else None
    examples = load_retrieval_examples([given])
    rows = load_retrieval_rows([given], cache)
    assert isinstance(rows.columns["sent"], Mapped) == cached
    assert list(rows) == examples
    indices = [len(examples) - 1, 0, 3, 0]
    got = collate_pairs(CaptionDataset(rows, reader, tokenizer, 6, cache).__getitems__(indices))
    np.testing.assert_array_equal(
        got["input_ids"].numpy(), _tokens(tokenizer, [examples[i].sent for i in indices], 6)
    )
    feats, pos = _visual(reader, [examples[i].img_id for i in indices])
    np.testing.assert_array_equal(got["visual_feats"].float().numpy(), feats)
    np.testing.assert_array_equal(got["visual_pos"].numpy(), pos)
    assert got["ids"] == [examples[i].caption_id for i in indices]
    # evaluation pairs: every caption with every image, in first-use order
    gallery = list(dict.fromkeys(e.img_id for e in examples))
    pairs = PairDataset(rows, reader, tokenizer, 6, cache)
    assert pairs.gallery == gallery and len(pairs) == len(examples) * len(gallery)
    items = [0, len(pairs) - 1, 5, len(gallery) + 1]
    got = collate_pairs(pairs.__getitems__(items))
    chosen = [(examples[i // len(gallery)], gallery[i % len(gallery)]) for i in items]
    assert got["ids"] == [pair_key(e.caption_id, img) for e, img in chosen]
    assert got["labels"].tolist() == [int(e.label == img) for e, img in chosen]
    np.testing.assert_array_equal(
        got["input_ids"].numpy(), _tokens(tokenizer, [e.sent for e, _ in chosen], 6)
    )
    np.testing.assert_array_equal(
        got["visual_feats"].float().numpy(), _visual(reader, [i for _, i in chosen])[0]
    )


def test_cache_reused_and_pickled_small(store, tmp_path, monkeypatch):  # noqa: F811
    path, tokenizer = store
    given = [str(_write(tmp_path)["karpathy"]) + "#test"]
    cache = tmp_path / "cache"
    first = load_retrieval_rows(given, cache)
    with monkeypatch.context() as m:
        m.setattr(retrieval_mod, "load_retrieval_examples", None)  # reading the file again would fail
        assert list(load_retrieval_rows(given, cache)) == list(first)
    assert load_retrieval_rows([given[0].replace("#test", "#train")], cache).key != first.key
    data = CaptionDataset(first, FeatureReader(path), tokenizer, 6, cache)
    back = pickle.loads(pickle.dumps(data))
    assert isinstance(back.examples.columns["sent"], Mapped)
    assert collate_pairs(back.__getitems__([1, 0]))["ids"] == [first[1].caption_id, first[0].caption_id]


def test_errors_are_those_of_the_object_path(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"img_id": "im1", "sentences": ["ok", 3]}]))
    with pytest.raises(ValueError) as want:
        load_retrieval_examples([bad])
    with pytest.raises(ValueError) as got:
        load_retrieval_rows([bad], tmp_path / "cache")
    assert str(got.value) == str(want.value) and "sentence 1 is not a string" in str(got.value)
