"""The pre-training corpus as columns: the same examples, answer table, token ids and batches as the
files read into objects (a reference written here), a cache that is reused, refreshed and never half
written, and one-line errors for broken files."""

from __future__ import annotations

import json
import os
import pickle
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

import pipelines.data.corpus as corpus_mod
from pipelines.data.answers import AnswerTable
from pipelines.data.corpus import PretrainCorpus, load_corpus
from pipelines.data.masking import PretrainCollator
from pipelines.data.pretrain import PretrainDataset, PretrainExample, read_pretrain_json
from pipelines.data.text import EncodedTexts, build_vocab, load_tokenizer
from pipelines.engine.trainer import BatchDataset
from pipelines.tasks.pretrain import PretrainConfig, PretrainTask
from storage import FeatureReader, FeatureWriter, RegionFeatures

DIM, BOXES = 8, 5
SHAPES = ("circle", "square", "star", "heart")
COLOURS = ("red", "green", "blue", "Two", "2", "the red", "grey", "gray")


def _rows(images: list[str], rng: np.random.Generator) -> list[dict]:
    """Community rows: captions, questions with soft labels (answers that normalise alike, an empty label,
    a negative score), a source with no labels, sentences shared across images, non-ASCII text."""
    rows = []
    for n, img in enumerate(images):
        k = int(rng.integers(1, 4))
        caps = [f"a {rng.choice(COLOURS)} {rng.choice(SHAPES)} beside {j} shapes" for j in range(k)]
        if n % 3 == 0:
            caps.append("there are some shapes")  # held by many images: never a mismatch for them
        qs = [f"what colour is the {rng.choice(SHAPES)} número {j}?" for j in range(int(rng.integers(0, 3)))]
        labels = []
        for _ in qs:
            answers = rng.choice(COLOURS, size=int(rng.integers(0, 4)), replace=False)
            labels.append({str(a): float(np.round(rng.uniform(-0.2, 1.0), 2)) for a in answers})
        row = {"img_id": img, "sentf": {"mscoco": caps, "vqa": qs}, "labelf": {"vqa": labels}}
        if n % 4 == 1:
            row["sentf"]["vg"] = [f"the {rng.choice(SHAPES)} is small"]
        rows.append(row)
    return rows


def _reference_examples(paths: list[Path]) -> list[PretrainExample]:
    """The files read whole and turned into one object per pair in loops."""
    out = []
    for path in paths:
        for row in json.loads(path.read_text(encoding="utf-8")):
            labelf = row.get("labelf") or {}
            for source, sents in row["sentf"].items():
                labels = labelf.get(source)
                for k, sent in enumerate(sents):
                    out.append(
                        PretrainExample(row["img_id"], sent, source, None if labels is None else labels[k])
                    )
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    images = [f"img{i:03d}" for i in range(40)]
    store = root / "feats.lmdb"
    with FeatureWriter(store, feature_dim=DIM, max_boxes=BOXES, dtype="float32") as w:
        for img in images:
            n = int(rng.integers(2, BOXES + 1))
            xy = rng.uniform(0, 50, (n, 2))
            w.put(
                RegionFeatures(
                    img_id=img,
                    img_h=100,
                    img_w=120,
                    boxes=np.concatenate([xy, xy + 20], 1).astype(np.float32),
                    features=rng.random((n, DIM)).astype(np.float32),
                    objects_id=rng.integers(0, 4, n),
                    objects_conf=rng.random(n).astype(np.float32),
                    attrs_id=rng.integers(0, 3, n),
                    attrs_conf=rng.random(n).astype(np.float32),
                )
            )
    rows = _rows(images, rng)
    train_a, train_b, valid = root / "train_a.json", root / "train_b.json", root / "valid.json"
    train_a.write_text(json.dumps(rows[:20], indent=1, ensure_ascii=False), encoding="utf-8")
    train_b.write_text(json.dumps(rows[20:34]), encoding="utf-8")  # one line, no spaces to split on
    valid.write_text(json.dumps(rows[34:], indent=2), encoding="utf-8")
    vocab = build_vocab([train_a, train_b, valid], root / "vocab.txt", 120)
    return root, store, [train_a, train_b], [valid], vocab


def _config(data, cache: Path) -> PretrainConfig:
    _, store, train, valid, vocab = data
    return PretrainConfig(
        features=[str(store)],
        train_files=[str(p) for p in train],
        valid_files=[str(p) for p in valid],
        vocab=str(vocab),
        preset="tiny",
        token_cache=str(cache),
    )


def _batches(dataset, collate, seed: int, batch: int = 7, workers: int = 0) -> list[dict]:
    order = np.random.default_rng(seed).permutation(len(dataset))
    data = BatchDataset(dataset, collate, order, batch, (seed, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=workers)
    return list(loader)


def _assert_same(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for key, value in a.items():
        if isinstance(value, dict):
            _assert_same(value, b[key], f"{where} {key}")
        elif isinstance(value, torch.Tensor):
            assert value.dtype == b[key].dtype and torch.equal(value, b[key]), f"{where} {key}"
        else:
            assert value == b[key], f"{where} {key}"


@pytest.mark.parametrize("chunk", [corpus_mod.READ_CHUNK, 37])
def test_columns_give_the_object_paths_examples_and_batches(data, tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(corpus_mod, "READ_CHUNK", chunk)  # 37 characters: elements cut at every spot
    monkeypatch.setattr(corpus_mod, "FLUSH_PAIRS", 5)  # columns appended in many pieces
    if chunk == 37:  # answers counted and labelled a few pairs at a time
        monkeypatch.setattr(corpus_mod, "PAIRS_STEP", 4)
    _, store, train_files, valid_files, _ = data
    cfg = _config(data, tmp_path / "cache")
    task = PretrainTask(cfg)
    train, valid = _reference_examples(train_files), _reference_examples(valid_files)
    assert list(task.train_examples) == train and list(task.valid_examples) == valid
    assert read_pretrain_json(train_files) == train

    # the object path: a table built from the label dicts, answers looked up one example at a time
    table = AnswerTable.build((e.label for e in train if e.label), cfg.answer_min_count, cfg.max_answers)
    assert task.answers == table and len(table) > 3
    masking = task.collator.cfg
    reader = FeatureReader([str(store)])
    texts = {
        n: EncodedTexts(task.tokenizer, [e.sentence for e in ex], masking.max_seq_len)
        for n, ex in (("t", train), ("v", valid))
    }
    pad = task.tokenizer.pad_token_id
    answers = {
        n: [tuple(table.labels(e.label).items()) if e.label else () for e in ex]
        for n, ex in (("t", train), ("v", valid))
    }
    assert any(len(a) > 1 for a in answers["t"]) and any(e.label == {} for e in train)
    ref_train = PretrainDataset(train, reader, texts["t"], pad, answers["t"], False, BOXES)
    ref_valid = PretrainDataset(valid, reader, texts["v"], pad, answers["v"], True, BOXES)
    ref_collate = PretrainCollator(task.tokenizer, train, BOXES, masking, texts=texts["t"], held=valid)
    got_train, got_valid = task.train_dataset(), task.valid_dataset()
    for ref, got, n in ((ref_train, got_train, 30), (ref_valid, got_valid, 7)):
        for i in range(n):
            np.testing.assert_array_equal(got.texts[i], ref.texts[i])
        want, have = _batches(ref, ref_collate, 3), _batches(got, task.collate, 3)
        assert len(want) == len(have) > 1
        for g, (a, b) in enumerate(zip(want, have, strict=True)):
            _assert_same(a, b, f"batch {g}")
    assert any((b["matched_labels"] == 0).any() for b in have)


def test_second_run_maps_the_cache_and_changed_files_convert_again(data, tmp_path, monkeypatch, caplog):
    _, _, train_files, _, _ = data
    cache = tmp_path / "cache"
    first = list(load_corpus(train_files, cache))
    made = sorted(p.name for p in cache.iterdir())
    assert len(made) == 1 and made[0].startswith("corpus-"), "one folder, no temporary left behind"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((cache / made[0]).stat().st_mode) == 0o777 & ~umask, "readable as the umask says"

    def no_conversion(*args):
        raise AssertionError("converted again")

    with monkeypatch.context() as m:
        m.setattr(corpus_mod, "convert", no_conversion)
        again = load_corpus(train_files, cache)
    assert isinstance(again.columns["image"], np.memmap)
    assert list(again) == first
    del again
    # a damaged column is noticed and converted again
    column = cache / made[0] / "image.bin"
    column.write_bytes(column.read_bytes()[:-4])
    assert list(load_corpus(train_files, cache)) == first
    assert "converting again" in caplog.text
    # an edited file gets its own conversion
    other = tmp_path / "edited.json"
    rows = json.loads(train_files[1].read_text())
    rows[0]["sentf"]["mscoco"][0] = "an edited caption"
    other.write_text(json.dumps(rows))
    edited = load_corpus([train_files[0], other], cache)
    assert len(list(cache.iterdir())) == 2
    changed = [i for i, (a, b) in enumerate(zip(edited, first, strict=True)) if a != b]
    assert len(changed) == 1 and edited[changed[0]].sentence == "an edited caption"


def test_a_mapped_corpus_pickles_as_its_files(data, tmp_path):
    _, _, train_files, _, _ = data
    corpus = load_corpus(train_files, tmp_path / "cache")
    kept = corpus.select(np.arange(len(corpus)) % 2 == 0)
    data_bytes = sum(c.nbytes for c in corpus.columns.values())
    blob = pickle.dumps(kept)
    assert len(blob) < data_bytes, "the columns travel as file names"
    back = pickle.loads(blob)
    assert list(back) == list(kept) == list(corpus)[::2]
    # a selection's answers are those of its pairs, looked up one by one
    table = AnswerTable.build(e.label for e in corpus if e.label)
    labels, scores = back.answer_labels(table).gather(np.arange(len(back)))
    for example, row, score in zip(back, labels, scores, strict=True):
        want = table.labels(example.label) if example.label else {}
        assert dict(
            zip(row[row != -100].tolist(), score[row != -100].tolist(), strict=True)
        ) == pytest.approx(want)
        assert list(row[row != -100]) == list(want), "in the order the label names them"


def test_images_without_sentences_are_not_in_the_table(tmp_path):
    path = tmp_path / "rows.json"
    rows = [{"img_id": "empty", "sentf": {"x": []}}, {"img_id": "full", "sentf": {"x": ["a"], "y": []}}]
    path.write_text(json.dumps(rows))
    corpus = load_corpus([path], None)
    assert corpus.images == ["full"] and len(corpus) == 1


@pytest.mark.parametrize(
    "text, message",
    [
        ('[{"img_id": "a", "sentf": {"x": ["s"]}},', "not valid JSON"),
        ('{"img_id": "a", "sentf": {"x": ["s"]}}', "expected a JSON list"),
        ('[{"img_id": "a", "sentf": {"x": ["s"]}}] [', r"not valid JSON \(Extra data"),
        ('[{"img_id": "a", "sentf": {"x": ["s"]}} {"img_id": "b"}]', "Expecting ',' delimiter at line 1"),
        ('[{"img_id": "a", "sentf": {"x": ["s"]}}, 7]', r"row 1: expected an object"),
        (
            '[\n{"img_id": "a", "sentf": {"x": ["s", 3]}}]',
            r"row 0 \(img_id 'a'\): sentf\['x'\] must be a list",
        ),
    ],
)
def test_broken_files_name_the_file_and_the_spot(tmp_path, monkeypatch, text, message):
    monkeypatch.setattr(corpus_mod, "READ_CHUNK", 5)
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_corpus([path], tmp_path / "cache")
    assert str(path) in str(err.value)
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")], "no temporary left"


def test_not_utf8_is_one_error(tmp_path):
    path = tmp_path / "latin.json"
    path.write_bytes('[{"img_id": "a", "sentf": {"x": ["caf\u00e9"]}}]'.encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        load_corpus([path], None)


def test_examples_in_memory_are_a_corpus_too():
    examples = [PretrainExample("i1", "a b", "x", {"yes": 1.0}), PretrainExample("i2", "c", "y")]
    corpus = PretrainCorpus.from_examples(examples)
    assert list(corpus) == examples and corpus.image_ids([1, 0]) == ["i2", "i1"]


def test_damaged_token_ids_are_tokenised_again(data, tmp_path, caplog):
    from pipelines.data.corpus import corpus_texts

    _, _, train_files, _, vocab = data
    cache = tmp_path / "cache"
    corpus = load_corpus(train_files, cache)
    tokenizer = load_tokenizer(vocab)
    want = EncodedTexts(tokenizer, [e.sentence for e in corpus], 12)
    every = np.arange(len(corpus))
    assert (corpus_texts(corpus, tokenizer, 12, cache).padded(every, 0) == want.padded(every, 0)).all()
    (folder,) = cache.glob("corpus-tokens-*")
    ids = np.fromfile(folder / "ids.bin", np.int32)
    ids[5] = len(tokenizer) + 3  # an id past the vocabulary
    ids.tofile(folder / "ids.bin")
    assert (corpus_texts(corpus, tokenizer, 12, cache).padded(every, 0) == want.padded(every, 0)).all()
    assert "outside the vocabulary" in caplog.text
    offsets = np.fromfile(folder / "offsets.bin", np.int64)
    offsets[3] = offsets[4] + 1  # a sentence of negative length
    offsets.tofile(folder / "offsets.bin")
    assert (corpus_texts(corpus, tokenizer, 12, cache).padded(every, 0) == want.padded(every, 0)).all()
    assert "do not index its ids" in caplog.text
