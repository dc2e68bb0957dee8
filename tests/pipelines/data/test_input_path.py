"""The batched input path against per-example references: one store read per micro-batch, QA batches,
the same pre-training batches whatever the loader workers or the resume point, and the token cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.data.answers import AnswerTable
from pipelines.data.qa import QADataset, QAExample, collate_qa, soft_target
from pipelines.data.regions import normalized_boxes
from pipelines.data.text import EncodedTexts, build_vocab, load_tokenizer
from pipelines.engine.trainer import BatchDataset
from pipelines.tasks.pretrain import PretrainConfig, PretrainTask
from storage import FeatureReader, FeatureWriter, RegionFeatures
from tests.pipelines.tasks.synthetic_pretrain import make_pretrain_data

DIM = 8


def _record(i: int, rng: np.random.Generator) -> RegionFeatures:
    n = int(rng.integers(1, 6))
    xy = rng.uniform(0, 50, size=(n, 2))
    return RegionFeatures(
        img_id=f"im{i}",
        img_h=60 + i,
        img_w=80,
        boxes=np.concatenate([xy, xy + 30], 1).astype(np.float32),
        features=rng.random((n, DIM), dtype=np.float32),
        objects_id=rng.integers(-1, 9, size=n),
        objects_conf=rng.random(n, dtype=np.float32),
        attrs_id=rng.integers(5, size=n),
        attrs_conf=rng.random(n, dtype=np.float32),
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("input")
    rng = np.random.default_rng(0)
    with FeatureWriter(root / "f.lmdb", feature_dim=DIM, max_boxes=5, dtype="float16") as w:
        for i in range(12):
            w.put(_record(i, rng))
    corpus = root / "corpus.txt"
    corpus.write_text("what color is the dog\nhow many cats are on the red table\nis it blue\n")
    return root / "f.lmdb", load_tokenizer(build_vocab([corpus], root / "vocab.txt", 80))


def test_read_batch_equals_the_records_read_one_by_one(store):
    reader = FeatureReader(store[0])
    ids = ["im3", "im0", "im3", "im7"]  # repeats: one read, two rows
    batch = reader.read_batch(ids)
    assert batch.features.dtype == np.float16 and batch.img_ids == ids
    width = max(reader[i].num_boxes for i in ids)
    assert batch.features.shape == (4, width, DIM)
    for k, img_id in enumerate(ids):
        rec = reader[img_id]
        m = rec.num_boxes
        assert batch.num_boxes[k] == m and (batch.img_h[k], batch.img_w[k]) == (rec.img_h, rec.img_w)
        for name in ("features", "boxes", "objects_id", "objects_conf", "attrs_id", "attrs_conf"):
            np.testing.assert_array_equal(getattr(batch, name)[k, :m], getattr(rec, name))
            assert not getattr(batch, name)[k, m:].any(), f"{name} padding"
    assert reader.read_batch(ids, width=5).features.shape == (4, 5, DIM)
    with pytest.raises(ValueError, match="more than the 1 slots"):
        reader.read_batch(ids, width=1)
    with pytest.raises(KeyError, match="nope"):
        reader.read_batch(["im1", "nope"])


def test_qa_batches_equal_the_per_question_reference(store):
    path, tokenizer = store
    reader = FeatureReader(path)
    table = AnswerTable(["red", "2", "blue", "yes"])
    rng = np.random.default_rng(1)
    words = ["what", "color", "is", "the", "dog", "how", "many", "cats", "are", "on", "red", "table"]
    examples = [
        QAExample(
            question_id=q,
            img_id=f"im{int(rng.integers(12))}",
            sent=" ".join(rng.choice(words, size=int(rng.integers(2, 12)))),
            label={"red": 1.0, "two": 0.3} if q % 3 else {"green": 1.0},
        )
        for q in range(20)
    ]
    data = QADataset(examples, reader, tokenizer, table, max_length=8)
    indices = [5, 0, 13, 7, 7, 19]
    got = collate_qa(data.__getitems__(indices), tokenizer.pad_token_id)
    # the reference: each question tokenised alone, each record read alone, then padded in loops
    ids = [tokenizer(examples[i].sent, truncation=True, max_length=8)["input_ids"] for i in indices]
    recs = [reader[examples[i].img_id] for i in indices]
    length, slots = max(map(len, ids)), max(r.num_boxes for r in recs)
    want_ids = np.zeros((len(indices), length), np.int64)
    want_feats = np.zeros((len(indices), slots, DIM), np.float32)
    want_pos = np.zeros((len(indices), slots, 4), np.float32)
    for k, (t, r) in enumerate(zip(ids, recs, strict=True)):
        want_ids[k, : len(t)] = t
        want_feats[k, : r.num_boxes] = r.features
        want_pos[k, : r.num_boxes] = normalized_boxes(r)
    np.testing.assert_array_equal(got["input_ids"].numpy(), want_ids)
    np.testing.assert_array_equal(
        got["attention_mask"].numpy(), [[int(c < len(t)) for c in range(length)] for t in ids]
    )
    np.testing.assert_array_equal(got["visual_feats"].float().numpy(), want_feats)
    np.testing.assert_array_equal(got["visual_pos"].numpy(), want_pos)
    np.testing.assert_array_equal(got["visual_attention_mask"].numpy().sum(1), [r.num_boxes for r in recs])
    np.testing.assert_array_equal(
        got["labels"].numpy(), [soft_target(examples[i].label, table) for i in indices]
    )
    assert got["ids"] == indices
    # one question at a time, joined, gives the same batch
    joined = collate_qa([data[i] for i in indices], tokenizer.pad_token_id)
    for key in ("input_ids", "attention_mask", "visual_feats", "visual_pos", "labels"):
        assert torch.equal(joined[key], got[key]), key


@pytest.fixture(scope="module")
def pretrain_task(tmp_path_factory):
    data = make_pretrain_data(tmp_path_factory.mktemp("pre"), images=24, valid_images=2)
    cfg = PretrainConfig(
        features=[str(data.features)], train_files=[str(data.train)], vocab=str(data.vocab), preset="tiny"
    )
    return PretrainTask(cfg)


def _batches(task, workers: int, indices: list[int]) -> list[dict]:
    dataset = task.train_dataset()
    order = np.random.default_rng([0, 0, 3]).permutation(len(dataset))
    data = BatchDataset(dataset, task.collate, order, 8, (0, 0, 3))
    loader = torch.utils.data.DataLoader(data, batch_size=None, sampler=indices, num_workers=workers)
    return list(loader)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


@pytest.mark.slow
def test_pretrain_batches_do_not_depend_on_workers_or_resume(pretrain_task):
    every = list(range(-(-len(pretrain_task.train_dataset()) // 8)))
    alone = _batches(pretrain_task, 0, every)
    assert alone[0]["visual_feats"].dtype == torch.float32  # the synthetic store is float32
    for workers in (1, 2):
        for a, b in zip(alone, _batches(pretrain_task, workers, every), strict=True):
            _assert_same(a, b)
    for a, b in zip(alone[5:], _batches(pretrain_task, 2, every[5:]), strict=True):  # resumed at batch 5
        _assert_same(a, b)
    assert not torch.equal(alone[0]["input_ids"], alone[1]["input_ids"])


class _Counting:
    """A tokenizer that counts its calls."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kw):
        self.calls += 1
        return self.tokenizer(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_token_cache_is_reused_and_invalidated_by_vocab_or_data(tmp_path, store):
    _, tokenizer = store
    sents = ["what color is the dog", "how many cats", "is it blue"]
    cache = tmp_path / "cache"
    counting = _Counting(tokenizer)
    first = EncodedTexts(counting, sents, 8, cache_dir=cache)
    assert counting.calls == 1 and len(list(cache.iterdir())) == 1
    again = EncodedTexts(counting, sents, 8, cache_dir=cache)
    assert counting.calls == 1, "the cached ids were read back"
    np.testing.assert_array_equal(again.padded(np.arange(3), 0), first.padded(np.arange(3), 0))
    EncodedTexts(counting, [*sents[:2], "is it red"], 8, cache_dir=cache)
    assert counting.calls == 2, "a changed sentence is tokenised again"
    EncodedTexts(counting, sents, 4, cache_dir=cache)
    assert counting.calls == 3, "another length limit is tokenised again"
    corpus = tmp_path / "c.txt"
    corpus.write_text("what colour is the cat\n")
    other = _Counting(load_tokenizer(build_vocab([corpus], tmp_path / "v.txt", 60)))
    changed = EncodedTexts(other, sents, 8, cache_dir=cache)
    assert other.calls == 1, "another vocabulary is tokenised again"
    assert len(list(cache.iterdir())) == 4
    assert json.dumps(changed.padded(np.arange(3), 0).tolist()) != json.dumps(
        first.padded(np.arange(3), 0).tolist()
    )
