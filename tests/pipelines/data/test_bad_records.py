"""Training reads only sound records: a bad one stops `pretrain`/`finetune` before any step, naming the
record and the store, or with --skip-bad-records is logged and its examples dropped."""

from __future__ import annotations

import json
import logging
import struct

import lmdb
import numpy as np
import pytest

from pipelines.cli import main as xmodal
from pipelines.data.bad_records import bad_records, drop_bad
from pipelines.tasks.pretrain import PretrainConfig, PretrainTask
from storage import FeatureReader
from storage.codec import CRC_OFFSET, checksum, decode, encode
from storage.metadata import RECORDS_DB

from ..tasks.synthetic_pretrain import make_pretrain_data, tiny_run_overrides

pytestmark = pytest.mark.usefixtures("one_thread")

# the four trials of issue 16: each was "loss is nan at step 5" before
SPOILS = {
    "img0001": ("inf feature", "features(0, 3) is inf"),
    "img0003": ("zero width", "image size 0x120 is not positive"),
    "img0005": ("nan box", "boxes(1, 2) is nan"),
    "img0007": ("label", "objects_id[0] is 999999"),
}


def _spoil(store, img_id: str, how: str) -> None:
    """Rewrite a stored record with a bad value and a valid checksum, as faulty software might."""
    reader = FeatureReader(store)
    value = encode(reader[img_id], "float32")
    reader.close()  # lmdb opens a store once per process
    rec = decode(value)  # arrays are views into `value`
    if how == "inf feature":
        rec.features[0, 3] = np.inf
    elif how == "nan box":
        rec.boxes[1, 2] = np.nan
    elif how == "label":
        rec.objects_id[0] = 999999
    w = 0 if how == "zero width" else rec.img_w
    struct.pack_into("<II", value, 16, rec.img_h, w)
    struct.pack_into("<I", value, CRC_OFFSET, checksum(value))
    env = lmdb.open(str(store), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(img_id.encode(), bytes(value), db=env.open_db(RECORDS_DB, txn=txn))
    env.close()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    data = make_pretrain_data(tmp_path_factory.mktemp("bad_records"), images=16, valid_images=4)
    for img_id, (how, _) in SPOILS.items():
        _spoil(data.features, img_id, how)
    return data


def test_each_bad_record_is_named_or_skipped(data, caplog):
    reader = FeatureReader(data.features)
    with pytest.raises(ValueError, match=r"record 'img0001' of store .*feats\.lmdb is unusable: features"):
        bad_records(reader, data.ids, skip=False)
    with caplog.at_level(logging.WARNING):
        bad = bad_records(reader, data.ids, skip=True)
    assert bad.keys() == SPOILS.keys()
    for img_id, (_, reason) in SPOILS.items():
        assert reason in bad[img_id]
        assert sum(f"skipping record {img_id!r}" in r.getMessage() for r in caplog.records) == 1


def test_drop_bad_keeps_the_examples_of_sound_records(data):
    examples = [("a", ("img0000", "img0001")), ("b", ("img0002",)), ("c", ("img0005",))]
    kept = drop_bad(examples, lambda e: e[1], FeatureReader(data.features), True, "pairs")
    assert kept == [examples[1]]


def test_pretrain_stops_before_training_with_one_line(data, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["pretrain", "--features", str(data.features), "--train", str(data.train)]
    argv += ["--vocab", str(data.vocab), "--out", str(out), "--max-steps", "1", *tiny_run_overrides()]
    assert xmodal(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("xmodal pretrain: record 'img0001' of store ")
    assert "--skip-bad-records" in err
    assert not (out / "checkpoints").exists()


def test_skip_bad_records_trains_on_the_rest(data, tmp_path, capsys):
    cfg = PretrainConfig(features=[str(data.features)], train_files=[str(data.train)], vocab=str(data.vocab))
    cfg.skip_bad_records = True
    task = PretrainTask(cfg)
    used = {e.img_id for e in task.train_examples}
    assert used and not used & SPOILS.keys()
    assert len(used) == 16 - len(SPOILS)
    out = tmp_path / "run"
    argv = ["pretrain", "--features", str(data.features), "--train", str(data.train), "--skip-bad-records"]
    argv += ["--vocab", str(data.vocab), "--out", str(out), "--max-steps", "2", "--batch-size", "4"]
    assert xmodal(argv + tiny_run_overrides()) == 0


def test_finetune_names_the_bad_record_or_skips_its_questions(data, tmp_path, capsys):
    rows = [
        {"question_id": i, "img_id": img_id, "sent": "what color?", "label": {"red": 1.0}}
        for i, img_id in enumerate(data.ids[:8])
    ]
    train = tmp_path / "vqa.json"
    train.write_text(json.dumps(rows))
    argv = ["finetune", "vqa", "--features", str(data.features), "--train", str(train)]
    argv += ["--vocab", str(data.vocab), "--out", str(tmp_path / "run"), "--max-steps", "1"]
    argv += ["task.preset=tiny", "train.loader_workers=0", "task.model={visual_feat_dim: 32}"]
    assert xmodal(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("xmodal finetune: record 'img0001' of store ") and "\n" not in err
    assert xmodal([*argv, "--skip-bad-records", "--batch-size", "2"]) == 0
