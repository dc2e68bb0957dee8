"""The batched input path against per-example references: one store read per micro-batch, QA batches,
the same pre-training batches whatever the loader workers or the resume point, and the token cache."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch

from pipelines.data.answers import AnswerTable
from pipelines.data.captions import CaptionDataset, CaptionExample, Vocabulary, collate_captions
from pipelines.data.nlvr2 import NLVR2Dataset, NLVR2Example, collate_nlvr2
from pipelines.data.qa import QADataset, QAExample, collate_qa, soft_target
from pipelines.data.regions import normalized_boxes
from pipelines.data.retrieval import CaptionDataset as RetrievalCaptions
from pipelines.data.retrieval import (
    PairDataset,
    RetrievalExample,
    candidate_inputs,
    collate_candidates,
    collate_pairs,
    pair_key,
)
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


def _reference_regions(reader, img_ids: list[str], slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each record read alone, widened to float32 and padded in a loop: (feats, boxes, valid counts)."""
    feats = np.zeros((len(img_ids), slots, DIM), np.float32)
    pos = np.zeros((len(img_ids), slots, 4), np.float32)
    for k, img in enumerate(img_ids):
        rec = reader[img]
        feats[k, : rec.num_boxes] = rec.features
        pos[k, : rec.num_boxes] = normalized_boxes(rec)
    return feats, pos, np.array([reader[i].num_boxes for i in img_ids])


def _reference_text(tokenizer, sents: list[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    ids = [tokenizer(s, truncation=True, max_length=max_length)["input_ids"] for s in sents]
    out = np.zeros((len(ids), max(map(len, ids))), np.int64)
    for k, t in enumerate(ids):
        out[k, : len(t)] = t
    return out, (out != 0).astype(np.int64)


def _assert_visual(got: dict, feats: np.ndarray, pos: np.ndarray, counts: np.ndarray) -> None:
    assert got["visual_feats"].dtype == torch.float16, "features stay as stored until the device"
    shape = got["visual_feats"].shape[:-2]
    np.testing.assert_array_equal(
        got["visual_feats"].float().numpy(), feats.reshape(*shape, *feats.shape[1:])
    )
    np.testing.assert_array_equal(got["visual_pos"].numpy(), pos.reshape(*shape, *pos.shape[1:]))
    np.testing.assert_array_equal(got["visual_attention_mask"].numpy().sum(-1), counts.reshape(shape))


SENTS = ["what color is the dog", "how many cats are on the red table", "is it blue", "the dog is red"]


def test_nlvr2_batches_equal_the_per_statement_reference(store):
    path, tokenizer = store
    reader = FeatureReader(path)
    examples = [
        NLVR2Example(f"s{i}", f"im{i % 12}", f"im{(5 * i + 1) % 12}", SENTS[i % 4], i % 2) for i in range(15)
    ]
    data = NLVR2Dataset(examples, reader, tokenizer, max_length=6)
    indices = [3, 14, 0, 3, 9]
    got = collate_nlvr2(data.__getitems__(indices), tokenizer.pad_token_id)
    imgs = [img for i in indices for img in examples[i].images]
    slots = max(reader[i].num_boxes for i in imgs)
    _assert_visual(got, *_reference_regions(reader, imgs, slots))
    ids, mask = _reference_text(tokenizer, [examples[i].sent for i in indices], 6)
    np.testing.assert_array_equal(got["input_ids"].numpy(), ids)
    np.testing.assert_array_equal(got["attention_mask"].numpy(), mask)
    assert got["labels"].tolist() == [i % 2 for i in indices] and got["ids"] == [f"s{i}" for i in indices]
    joined = collate_nlvr2([data[i] for i in indices], tokenizer.pad_token_id)
    for key in ("input_ids", "attention_mask", "visual_feats", "visual_pos", "labels"):
        assert torch.equal(joined[key], got[key]), key


def _retrieval_examples(n: int) -> list[RetrievalExample]:
    return [RetrievalExample(f"im{i % 7}#{i}", f"im{i % 7}", SENTS[i % 4], f"im{i % 7}") for i in range(n)]


def test_retrieval_training_batches_equal_the_per_caption_reference(store):
    path, tokenizer = store
    reader = FeatureReader(path)
    examples = _retrieval_examples(20)
    data = RetrievalCaptions(examples, reader, tokenizer, max_length=6)
    indices = [4, 11, 2, 19, 7, 1]  # images 4, 4, 2, 5, 0, 1
    sent = collate_candidates(data.__getitems__(indices), tokenizer.pad_token_id, np.random.default_rng(5))
    assert sent["visual_feats"].shape[0] == len(indices), "each caption's own image travels once"
    got = candidate_inputs(sent)
    # the reference: the draws of the per-example collation, regions of each chosen image read alone
    rng = np.random.default_rng(5)
    owners: dict[str, int] = {}
    for k, i in enumerate(indices):
        owners.setdefault(examples[i].img_id, k)
    shown, labels = [], []
    for i in indices:
        own = examples[i].img_id
        others = [owners[img] for img in owners if img != own]
        chosen = [owners[own], *rng.choice(others, size=3, replace=False).tolist()]
        order = rng.permutation(4)
        labels.append(int(np.flatnonzero(order == 0)[0]))
        shown += [examples[indices[chosen[j]]].img_id for j in order]
    slots = max(reader[examples[i].img_id].num_boxes for i in indices)  # the batch's widest set
    _assert_visual(got, *_reference_regions(reader, shown, slots))
    assert got["labels"].tolist() == labels
    ids, mask = _reference_text(tokenizer, [examples[i].sent for i in indices], 6)
    np.testing.assert_array_equal(got["input_ids"].numpy(), ids)
    np.testing.assert_array_equal(got["attention_mask"].numpy(), mask)


def test_retrieval_pairs_equal_the_per_pair_reference(store):
    path, tokenizer = store
    reader = FeatureReader(path)
    examples = _retrieval_examples(9)
    data = PairDataset(examples, reader, tokenizer, max_length=6)
    assert len(data) == 9 * 7
    indices = [0, 8, 15, 62, 30]
    got = collate_pairs(data.__getitems__(indices), tokenizer.pad_token_id)
    pairs = [(examples[i // 7], data.gallery[i % 7]) for i in indices]
    slots = max(reader[img].num_boxes for _, img in pairs)
    _assert_visual(got, *_reference_regions(reader, [img for _, img in pairs], slots))
    assert got["ids"] == [pair_key(ex.caption_id, img) for ex, img in pairs]
    assert got["labels"].tolist() == [int(ex.label == img) for ex, img in pairs]
    ids, _ = _reference_text(tokenizer, [ex.sent for ex, _ in pairs], 6)
    np.testing.assert_array_equal(got["input_ids"].numpy(), ids)


def test_caption_batches_equal_the_per_image_reference(store):
    path, _ = store
    reader = FeatureReader(path)
    vocab = Vocabulary(["a", "dog", "red", "cat"])
    words = [("a", "dog"), ("a", "red", "cat", "sat"), ("dog",), ("red", "red", "dog", "a", "cat")]
    examples = [
        CaptionExample(i, f"im{i}", tuple(words[(i + j) % 4] for j in range(1 + i % 3))) for i in range(10)
    ]
    data = CaptionDataset(examples, reader, vocab, max_length=4)
    indices = [6, 1, 9, 1]
    got = collate_captions(data.__getitems__(indices), np.random.default_rng(2), vocab.pad_id)
    rng = np.random.default_rng(2)
    chosen = [vocab.encode(c[int(rng.integers(len(c)))], 4) for c in (examples[i].label for i in indices)]
    padded = np.zeros((len(chosen), max(map(len, chosen))), np.int64)
    for k, c in enumerate(chosen):
        padded[k, : len(c)] = c
    np.testing.assert_array_equal(got["input_ids"].numpy(), padded[:, :-1])
    np.testing.assert_array_equal(got["labels"].numpy(), padded[:, 1:])
    imgs = [f"im{i}" for i in indices]
    _assert_visual(got, *_reference_regions(reader, imgs, max(reader[i].num_boxes for i in imgs)))
    assert got["ids"] == indices


def _nlvr2_batches(data, workers: int, indices: list[int]) -> list[dict]:
    order = np.random.default_rng([0, 0, 2]).permutation(len(data))
    batches = BatchDataset(data, collate_nlvr2, order, 4, (0, 0, 2))
    loader = torch.utils.data.DataLoader(batches, batch_size=None, sampler=indices, num_workers=workers)
    return list(loader)


def test_finetune_batches_do_not_depend_on_workers_or_resume(store, tmp_path):
    path, tokenizer = store
    examples = [
        NLVR2Example(f"s{i}", f"im{i % 12}", f"im{(i + 3) % 12}", SENTS[i % 4], i % 2) for i in range(18)
    ]
    counting = _Counting(tokenizer)
    data = NLVR2Dataset(examples, FeatureReader(path), counting, 6, cache_dir=tmp_path / "cache")
    NLVR2Dataset(examples, FeatureReader(path), counting, 6, cache_dir=tmp_path / "cache")
    assert counting.calls == 1, "the second run read the statements' ids from the run's cache"
    every = list(range(5))
    alone = _nlvr2_batches(data, 0, every)
    for a, b in zip(alone, _nlvr2_batches(data, 2, every), strict=True):
        _assert_same(a, b)
    for a, b in zip(alone[3:], _nlvr2_batches(data, 1, every[3:]), strict=True):  # resumed at batch 3
        _assert_same(a, b)


class _Asking(torch.utils.data.Dataset):
    """Items are their indices; records which indices it was asked to fetch ahead."""

    def __init__(self, size: int):
        self.size, self.asked = size, []

    def __len__(self) -> int:
        return self.size

    def __getitems__(self, indices):
        return list(indices)

    def request_ahead(self, indices) -> None:
        self.asked.append(list(indices))


def test_each_batch_asks_for_the_batch_its_process_reads_next(monkeypatch):
    import pipelines.engine.trainer as trainer

    order = np.random.default_rng(0).permutation(22)
    data = _Asking(22)
    batches = BatchDataset(data, lambda items, rng: items, order, 4, (0,))
    assert batches[1] == order[4:8].tolist()
    assert data.asked == [order[8:12].tolist()]  # alone: the next batch
    batches[5]  # the last (short) batch: nothing after it
    assert data.asked == [order[8:12].tolist()]
    # a loader worker of three is handed every third batch
    monkeypatch.setattr(trainer, "get_worker_info", lambda: types.SimpleNamespace(num_workers=3, id=1))
    batches[1]
    assert data.asked[-1] == order[16:20].tolist()
