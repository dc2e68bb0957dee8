"""Questions as memory-mapped columns: the same examples and batches as the object path, whatever the row
format; the cache reused, rebuilt when stale or damaged; a mapped dataset pickled as its folder."""

from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pytest

import pipelines.data.column_tokens as column_tokens_mod
import pipelines.data.columns as columns_mod
import pipelines.data.qa as qa_mod
from pipelines.data.answers import AnswerTable, normalize_answer
from pipelines.data.columns import Mapped
from pipelines.data.qa import QADataset, QARows, collate_qa, load_qa_examples, load_qa_rows, soft_target
from pipelines.data.regions import normalized_boxes
from pipelines.data.text import build_vocab, load_tokenizer
from pipelines.tasks.finetune import FinetuneConfig
from pipelines.tasks.finetuned import build_task
from storage import FeatureReader, FeatureWriter, RegionFeatures

DIM = 8
IMAGES = 12
WORDS = ["what", "color", "is", "the", "dog", "how", "many", "cats", "are", "on", "red", "table", "été"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    rng = np.random.default_rng(0)
    with FeatureWriter(root / "f.lmdb", feature_dim=DIM, max_boxes=5, dtype="float16") as w:
        for i in range(IMAGES):
            n = int(rng.integers(1, 6))
            xy = rng.uniform(0, 30, size=(n, 2)) + (60 if i == IMAGES - 1 else 0)  # the last image's: outside
            boxes = np.concatenate([xy, xy + 30], 1).astype(np.float32)
            ones = np.ones(n, np.float32)
            zeros = np.zeros(n, np.int64)
            feats = rng.random((n, DIM), dtype=np.float32)
            w.put(RegionFeatures(f"im{i}", 60 + i, 80, boxes, feats, zeros, ones, zeros, ones))
    corpus = root / "corpus.txt"
    corpus.write_text(" ".join(WORDS) + "\nhow many cats are on the red table\n")
    return root / "f.lmdb", load_tokenizer(build_vocab([corpus], root / "vocab.txt", 90))


def _sentence(rng) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(1, 14))))


def _write_files(root, n: int = 40, seed: int = 1) -> dict:
    """The same kind of questions in LXMERT's JSON, GQA-style JSON lines and an image/question/answers CSV."""
    rng = np.random.default_rng(seed)
    labels = [{"red": 1.0, "two": 0.3, "2": 0.9}, {}, {"green": 0.6}, {"yes": 1.0, "Yes.": 0.3}]
    lxmert = [
        {
            "question_id": 10**12 + q if q % 5 == 0 else q,
            "img_id": f"im{int(rng.integers(IMAGES))}",
            "sent": _sentence(rng),
            "label": labels[q % 4],
            "answer_type": ["other", "yes/no", None][q % 3],
            "question_type": "what color",
        }
        for q in range(n)
    ]
    gqa = [
        {"questionId": f"0{q}", "imageId": f"im{q % IMAGES}", "question": _sentence(rng), "answer": "yes"}
        for q in range(n // 2)
    ]
    files = {"lxmert": root / "train.json", "gqa": root / "gqa.jsonl", "csv": root / "qa.csv"}
    files["lxmert"].write_text(json.dumps(lxmert))
    files["gqa"].write_text("".join(json.dumps(r) + "\n" for r in gqa))
    lines = ["image,question,answers"] + [
        f"im{q % 7},{_sentence(rng)},red|red|dark red" for q in range(n // 3)
    ]
    files["csv"].write_text("\n".join(lines) + "\n")
    return files


def _reference(examples, indices, reader, tokenizer, table, max_length) -> dict:
    """A batch built question by question from the examples, in loops."""
    ids = [tokenizer(examples[i].sent, truncation=True, max_length=max_length)["input_ids"] for i in indices]
    recs = [reader[examples[i].img_id] for i in indices]
    length, slots = max(map(len, ids)), max(r.num_boxes for r in recs)
    want = {
        "input_ids": np.zeros((len(indices), length), np.int64),
        "visual_feats": np.zeros((len(indices), slots, DIM), np.float32),
        "visual_pos": np.zeros((len(indices), slots, 4), np.float32),
    }
    for k, (t, r) in enumerate(zip(ids, recs, strict=True)):
        want["input_ids"][k, : len(t)] = t
        want["visual_feats"][k, : r.num_boxes] = r.features
        want["visual_pos"][k, : r.num_boxes] = normalized_boxes(r)
    want["attention_mask"] = np.array([[int(c < len(t)) for c in range(length)] for t in ids])
    want["labels"] = np.array([soft_target(examples[i].label, table) for i in indices])
    want["ids"] = [examples[i].question_id for i in indices]
    return want


def _assert_batch(got: dict, want: dict) -> None:
    for key in ("input_ids", "attention_mask", "visual_pos", "labels"):
        np.testing.assert_array_equal(got[key].numpy(), want[key], err_msg=key)
    np.testing.assert_array_equal(got["visual_feats"].float().numpy(), want["visual_feats"])
    assert got["ids"] == want["ids"]
    assert [type(i) for i in got["ids"]] == [type(i) for i in want["ids"]]  # ints stay ints, text text


@pytest.mark.parametrize("kinds", [("lxmert",), ("gqa",), ("csv",), ("lxmert", "gqa", "csv")])
@pytest.mark.parametrize("cached", [False, True])
def test_rows_give_the_object_paths_examples_and_batches(store, tmp_path, monkeypatch, kinds, cached):
    monkeypatch.setattr(columns_mod, "FLUSH_ROWS", 7)  # columns appended in many pieces
    path, tokenizer = store
    reader = FeatureReader(path)
    files = [_write_files(tmp_path)[k] for k in kinds]
    cache = tmp_path / "cache" if cached else None
    examples = load_qa_examples(files)
    rows = load_qa_rows(files, cache)
    assert isinstance(rows.columns["sent"], Mapped) == cached
    assert list(rows) == examples and len(rows) == len(examples)
    assert [type(e.question_id) for e in rows] == [type(e.question_id) for e in examples]
    table = AnswerTable.build(e.label for e in examples if e.label is not None)
    assert AnswerTable.from_counts(rows.answer_counts(normalize_answer)) == table
    covered = [bool(table.labels(e.label or {})) for e in examples]
    assert (np.diff(rows.answer_labels(table).offsets) > 0).tolist() == covered
    data = QADataset(rows, reader, tokenizer, table, max_length=8, cache_dir=cache)
    rng = np.random.default_rng(3)
    labelled = [i for i, e in enumerate(examples) if e.label is not None]
    indices = [int(i) for i in rng.choice(labelled, size=9)]
    got = collate_qa(data.__getitems__(indices), tokenizer.pad_token_id)
    _assert_batch(got, _reference(examples, indices, reader, tokenizer, table, 8))
    # a selection (as --skip-missing makes) indexes its own rows
    keep = np.array([i % 3 != 1 for i in range(len(rows))])
    kept = [e for e, k in zip(examples, keep, strict=True) if k]
    sub = QADataset(rows.select(keep), reader, tokenizer, table, max_length=8, cache_dir=cache)
    labelled = [i for i, e in enumerate(kept) if e.label is not None]
    indices = [int(i) for i in rng.choice(labelled, size=7)]
    got = collate_qa(sub.__getitems__(indices), tokenizer.pad_token_id)
    _assert_batch(got, _reference(kept, indices, reader, tokenizer, table, 8))


def test_examples_given_as_objects_give_the_same_batches(store, tmp_path):
    path, tokenizer = store
    reader = FeatureReader(path)
    files = _write_files(tmp_path)
    examples = load_qa_examples([files["lxmert"]])
    table = AnswerTable(["red", "2", "yes", "green"])
    from_objects = QADataset(examples, reader, tokenizer, table, max_length=6)
    mapped = QADataset(
        load_qa_rows([files["lxmert"]], tmp_path / "c"), reader, tokenizer, table, 6, tmp_path / "c"
    )
    indices = [i for i, e in enumerate(examples) if e.label is not None][:11]
    want = _reference(examples, indices, reader, tokenizer, table, 6)
    for data in (from_objects, mapped):
        _assert_batch(collate_qa(data.__getitems__(indices), tokenizer.pad_token_id), want)


def _fail(*args, **kwargs):
    raise AssertionError("converted or tokenised again")


def test_second_run_maps_the_cache_and_a_changed_file_converts_again(store, tmp_path, monkeypatch):
    path, tokenizer = store
    files = [_write_files(tmp_path)["lxmert"]]
    cache = tmp_path / "cache"
    table = AnswerTable(["red", "2", "yes"])
    first = QADataset(load_qa_rows(files, cache), FeatureReader(path), tokenizer, table, 8, cache)
    with monkeypatch.context() as m:
        m.setattr(qa_mod, "_qa_records", _fail)
        m.setattr(column_tokens_mod, "_encoder", _fail)
        m.setattr(qa_mod, "answer_labels", _fail)
        again = QADataset(load_qa_rows(files, cache), FeatureReader(path), tokenizer, table, 8, cache)
    assert list(again.examples) == list(first.examples)
    assert isinstance(again.texts.ids, Mapped) and isinstance(again.targets.labels, Mapped)
    _write_files(tmp_path, seed=2)  # new questions in the same file
    assert list(load_qa_rows(files, cache)) == load_qa_examples(files) != list(first.examples)


@pytest.mark.parametrize("damage", ["truncate", "meta", "offsets"])
def test_a_damaged_cache_is_converted_again(store, tmp_path, caplog, damage):
    files = [_write_files(tmp_path)["lxmert"]]
    cache = tmp_path / "cache"
    rows = load_qa_rows(files, cache)
    folder = rows.directory
    if damage == "truncate":
        with open(folder / "sent.bin", "r+b") as fh:
            fh.truncate(3)
    elif damage == "meta":
        (folder / "meta.json").write_text("{not json")
    else:
        np.full(len(rows) + 1, 7, np.int64).tofile(folder / "qid_offsets.bin")
    with caplog.at_level(logging.WARNING):
        again = load_qa_rows(files, cache)
    assert "converting again" in caplog.text
    assert list(again) == load_qa_examples(files)


def test_damaged_targets_are_computed_again(store, tmp_path, caplog):
    path, tokenizer = store
    files = [_write_files(tmp_path)["lxmert"]]
    cache = tmp_path / "cache"
    table = AnswerTable(["red", "2", "yes"])
    rows = load_qa_rows(files, cache)
    first = QADataset(rows, FeatureReader(path), tokenizer, table, 8, cache)
    labels = first.targets.labels
    np.full(len(labels), 99, labels.dtype).tofile(labels.filename)  # labels outside the table
    with caplog.at_level(logging.WARNING):
        again = QADataset(load_qa_rows(files, cache), FeatureReader(path), tokenizer, table, 8, cache)
    assert "converting again" in caplog.text
    examples = load_qa_examples(files)
    indices = [i for i, e in enumerate(examples) if e.label is not None]
    want = _reference(examples, indices, FeatureReader(path), tokenizer, table, 8)
    _assert_batch(collate_qa(again.__getitems__(indices), tokenizer.pad_token_id), want)


def test_a_mapped_dataset_pickles_as_its_folders(store, tmp_path):
    path, tokenizer = store
    files = [_write_files(tmp_path, n=3000)["lxmert"]]
    cache = tmp_path / "cache"
    table = AnswerTable(["red", "2", "yes"])
    mapped = QADataset(load_qa_rows(files, cache), FeatureReader(path), tokenizer, table, 8, cache)
    in_memory = QADataset(load_qa_rows(files), FeatureReader(path), tokenizer, table, 8)
    small, large = len(pickle.dumps(mapped)), len(pickle.dumps(in_memory))
    assert small < 8000 < 20 * small < large
    back = pickle.loads(pickle.dumps(mapped))
    assert isinstance(back.examples.columns["sent"], Mapped)
    indices = [0, 5, 2999, 5]
    want = collate_qa(mapped.__getitems__(indices), tokenizer.pad_token_id)
    got = collate_qa(back.__getitems__(indices), tokenizer.pad_token_id)
    _assert_batch(got, {k: (v if k == "ids" else v.float().numpy()) for k, v in want.items()})


def test_row_errors_are_those_of_the_object_path(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps([{"question_id": 1, "img_id": "im1", "sent": "what", "label": {}}, {"sent": 3}])
    )
    with pytest.raises(ValueError) as want:
        load_qa_examples([bad])
    for cache in (None, tmp_path / "cache"):
        with pytest.raises(ValueError) as got:
            load_qa_rows([bad], cache)
        assert str(got.value) == str(want.value)
    assert not list((tmp_path / "cache").glob("qa-rows-*"))  # nothing half-written left behind
    with pytest.raises(FileNotFoundError) as want:
        load_qa_examples([tmp_path / "missing.json"])
    with pytest.raises(FileNotFoundError) as got:
        load_qa_rows([tmp_path / "missing.json"], tmp_path / "cache")
    assert str(got.value) == str(want.value)


def test_a_task_trains_on_mapped_rows(store, tmp_path, caplog):
    path, tokenizer = store
    files = _write_files(tmp_path)
    rows = json.loads(files["lxmert"].read_text())
    rows = [r for r in rows if r["label"]]
    rows.append({"question_id": "nowhere", "img_id": "im99", "sent": "what", "label": {"red": 1.0}})
    train = tmp_path / "train_labelled.json"
    train.write_text(json.dumps(rows))
    valid = tmp_path / "valid.json"
    valid.write_text(json.dumps([*rows[:3], {"question_id": -1, "img_id": "im0", "sent": "is it"}]))
    cfg = FinetuneConfig(
        task="vqa",
        features=[str(path)],
        train_files=[str(train)],
        valid_files=[str(valid)],
        vocab=str(path.parent / "vocab.txt"),
        preset="tiny",
        max_length=8,
        skip_missing=True,
        skip_bad_records=True,
    )
    with pytest.raises(ValueError, match="have no answer"):  # the validation file has unlabelled rows
        build_task(cfg, cache_dir=tmp_path / "cache")
    cfg.valid_files = []
    task = build_task(cfg, cache_dir=tmp_path / "cache")
    assert "skipped 1 examples whose images are not in the store" in caplog.text
    examples = [e for e in load_qa_examples([train]) if e.img_id not in ("im99", f"im{IMAGES - 1}")]
    assert f"skipped {len(rows) - 1 - len(examples)} of {len(rows) - 1} examples reading 1 bad" in caplog.text
    assert isinstance(task.train_examples, QARows)
    assert list(task.train_examples) == examples
    assert task.answers == AnswerTable.build(e.label for e in examples)
    data = task.train_dataset()
    indices = list(range(len(examples)))
    want = _reference(examples, indices, FeatureReader(path), tokenizer, task.answers, 8)
    _assert_batch(task.collate(data.__getitems__(indices), np.random.default_rng(0)), want)
