"""NLVR2 statements as memory-mapped columns: the object path's examples and batches, the cache reused or
rebuilt, a mapped dataset pickled as its folder, the task's checks over the image table."""

from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pytest

import pipelines.data.nlvr2 as nlvr2_mod
from pipelines.data.columns import Mapped
from pipelines.data.nlvr2 import NLVR2Dataset, NLVR2Rows, collate_nlvr2, load_nlvr2_examples, load_nlvr2_rows
from pipelines.data.regions import normalized_boxes
from pipelines.tasks.finetune import FinetuneConfig
from pipelines.tasks.finetuned import build_task
from storage import FeatureReader
from tests.pipelines.data.test_qa_rows import DIM, IMAGES, WORDS, store  # noqa: F401  (a fixture)


def _write(root, n: int = 30, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    labels = ["True", "False", 1, 0, None]
    rows = []
    for i in range(n):
        row = {
            "identifier": f"dev-{i}-0-{i % 2}",
            "img0": f"im{int(rng.integers(IMAGES - 1))}",
            "img1": f"im{int(rng.integers(IMAGES - 1))}",
            "sent": " ".join(rng.choice(WORDS, size=int(rng.integers(1, 12)))),
        }
        if labels[i % 5] is not None:
            row["label"] = labels[i % 5]
        rows.append(row)
    json_file, lines = root / "dev.json", root / "train.jsonl"
    json_file.write_text(json.dumps(rows[: n // 2]))
    lines.write_text("".join(json.dumps(r) + "\n" for r in rows[n // 2 :]))
    return [json_file, lines]


def _reference(examples, indices, reader, tokenizer, max_length) -> dict:
    ids = [tokenizer(examples[i].sent, truncation=True, max_length=max_length)["input_ids"] for i in indices]
    imgs = [img for i in indices for img in examples[i].images]
    recs = [reader[i] for i in imgs]
    slots, length = max(r.num_boxes for r in recs), max(map(len, ids))
    feats = np.zeros((len(imgs), slots, DIM), np.float32)
    pos = np.zeros((len(imgs), slots, 4), np.float32)
    for k, r in enumerate(recs):
        feats[k, : r.num_boxes], pos[k, : r.num_boxes] = r.features, normalized_boxes(r)
    tokens = np.zeros((len(indices), length), np.int64)
    for k, t in enumerate(ids):
        tokens[k, : len(t)] = t
    return {
        "input_ids": tokens,
        "attention_mask": np.array([[int(c < len(t)) for c in range(length)] for t in ids]),
        "visual_feats": feats.reshape(len(indices), 2, slots, DIM),
        "visual_pos": pos.reshape(len(indices), 2, slots, 4),
        "labels": [examples[i].label for i in indices],
        "ids": [examples[i].identifier for i in indices],
    }


def _assert_batch(got: dict, want: dict) -> None:
    for key in ("input_ids", "attention_mask", "visual_pos"):
        np.testing.assert_array_equal(got[key].numpy(), want[key], err_msg=key)
    np.testing.assert_array_equal(got["visual_feats"].float().numpy(), want["visual_feats"])
    assert got["labels"].tolist() == want["labels"] and got["ids"] == want["ids"]


@pytest.mark.parametrize("cached", [False, True])
def test_rows_give_the_object_paths_examples_and_batches(store, tmp_path, cached):  # noqa: F811
    path, tokenizer = store
    reader = FeatureReader(path)
    files = _write(tmp_path)
    cache = tmp_path / "cache" if cached else None
    examples = load_nlvr2_examples(files)
    rows = load_nlvr2_rows(files, cache)
    assert isinstance(rows.columns["sent"], Mapped) == cached
    assert list(rows) == examples
    assert rows.unlabelled_keys() == [e.identifier for e in examples if e.label is None]
    labelled = [i for i, e in enumerate(examples) if e.label is not None]
    for data, own in (
        (NLVR2Dataset(rows, reader, tokenizer, 6, cache), examples),
        (NLVR2Dataset(examples, reader, tokenizer, 6), examples),
        (NLVR2Dataset(rows.select(np.arange(len(rows)) % 4 != 2), reader, tokenizer, 6, cache), None),
    ):
        own = own or [e for i, e in enumerate(examples) if i % 4 != 2]
        indices = [i for i, e in enumerate(own) if e.label is not None][::-2] + labelled[:1]
        got = collate_nlvr2(data.__getitems__(indices), tokenizer.pad_token_id)
        _assert_batch(got, _reference(own, indices, reader, tokenizer, 6))
    got = collate_nlvr2(NLVR2Dataset(rows, reader, tokenizer, 6, cache).__getitems__([0, 4]))
    assert "labels" not in got  # statement 4 has no label


def test_cache_reused_rebuilt_when_damaged_and_pickled_small(store, tmp_path, monkeypatch, caplog):  # noqa: F811
    path, tokenizer = store
    files = _write(tmp_path, n=2000)
    cache = tmp_path / "cache"
    first = load_nlvr2_rows(files, cache)
    with monkeypatch.context() as m:
        m.setattr(nlvr2_mod, "_nlvr2_records", None)  # reading the files again would fail
        assert list(load_nlvr2_rows(files, cache)) == list(first)
    data = NLVR2Dataset(first, FeatureReader(path), tokenizer, 6, cache)
    assert (
        len(pickle.dumps(data))
        < 8000
        < 20 * len(pickle.dumps(data))
        < len(pickle.dumps(NLVR2Dataset(load_nlvr2_rows(files), FeatureReader(path), tokenizer, 6)))
    )
    back = pickle.loads(pickle.dumps(data))
    ids = [1, 1999, 0]
    assert collate_nlvr2(back.__getitems__(ids))["ids"] == [first[i].identifier for i in ids]
    (first.directory / "label.bin").write_bytes(b"\x01")
    with caplog.at_level(logging.WARNING):
        assert list(load_nlvr2_rows(files, cache)) == load_nlvr2_examples(files)
    assert "converting again" in caplog.text


def test_errors_are_those_of_the_object_path(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"identifier": "a", "img0": "x", "img1": "y", "sent": "s", "label": "maybe"}]))
    with pytest.raises(ValueError) as want:
        load_nlvr2_examples([bad])
    with pytest.raises(ValueError) as got:
        load_nlvr2_rows([bad], tmp_path / "cache")
    assert str(got.value) == str(want.value) and "label must be 0/1" in str(got.value)


def test_the_task_trains_on_mapped_rows(store, tmp_path, caplog):  # noqa: F811
    path, tokenizer = store
    rows = [json.loads(line) for line in _write(tmp_path)[1].read_text().splitlines()]
    rows = [r for r in rows if "label" in r]
    rows.append({"identifier": "gone", "img0": "im1", "img1": "im99", "sent": "is it", "label": 1})
    rows.append({"identifier": "bad", "img0": f"im{IMAGES - 1}", "img1": "im1", "sent": "is it", "label": 0})
    train = tmp_path / "labelled.json"
    train.write_text(json.dumps(rows))
    cfg = FinetuneConfig(
        task="nlvr2",
        features=[str(path)],
        train_files=[str(train)],
        vocab=str(path.parent / "vocab.txt"),
        preset="tiny",
        max_length=6,
        skip_missing=True,
        skip_bad_records=True,
    )
    task = build_task(cfg, cache_dir=tmp_path / "cache")
    assert isinstance(task.train_examples, NLVR2Rows)
    assert "skipped 1 examples whose images are not in the store" in caplog.text
    assert f"skipped 1 of {len(rows) - 1} examples reading 1 bad records" in caplog.text
    examples = [e for e in load_nlvr2_examples([train]) if e.identifier not in ("gone", "bad")]
    assert list(task.train_examples) == examples
    indices = list(range(len(examples)))
    got = task.collate(task.train_dataset().__getitems__(indices), np.random.default_rng(0))
    _assert_batch(got, _reference(examples, indices, FeatureReader(path), tokenizer, 6))
