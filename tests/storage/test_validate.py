"""Well-formed records holding values no model should see: named with their store, skipped on request."""

from __future__ import annotations

import logging
import pickle
import struct

import lmdb
import numpy as np
import pytest

from pipelines.cli import main
from storage import FeatureReader, FeatureWriter, RegionFeatures
from storage.codec import CRC_OFFSET, checksum, decode, encode
from storage.metadata import RECORDS_DB
from storage.records import UNKNOWN_LABEL
from storage.validate import BadRecordError, RecordLimits, problem
from storage.verify import verify

LIMITS = RecordLimits(feature_dim=64, max_boxes=36)


def spoil(rec: RegionFeatures, how: str) -> RegionFeatures:
    if how == "inf feature":
        rec.features[3, 5] = np.inf
    elif how == "nan box":
        rec.boxes[2, 1] = np.nan
    elif how == "zero width":
        rec.img_w = 0
    elif how == "box outside":
        rec.boxes[4] = [10, 10, rec.img_w * 3, 20]
    elif how == "inverted box":
        rec.boxes[1] = [50, 50, 10, 60]
    elif how == "object label":
        rec.objects_id[7] = 999999
    elif how == "negative attribute":
        rec.attrs_id[0] = -5
    elif how == "confidence":
        rec.objects_conf[0] = 7.0
    elif how == "rows":
        rec.objects_id = rec.objects_id[:-1]
    elif how == "width":
        rec.features = rec.features[:, :32]
    return rec


REASONS = {
    "inf feature": "features(3, 5) is inf",
    "nan box": "boxes(2, 1) is nan",
    "zero width": "image size 0x",
    "box outside": "box 4 (",
    "inverted box": "box 1 (50, 50, 10, 60)",
    "object label": "objects_id[7] is 999999, outside 0..1599",
    "negative attribute": "attrs_id[0] is -5",
    "confidence": "objects_conf[0] is 7",
    "rows": "objects_id has (35,) rows but there are 36 boxes",
    "width": "features are 32-d, the store's are 64-d",
}


@pytest.mark.parametrize("how", sorted(REASONS))
def test_each_kind_of_bad_value_is_named(make_record, how):
    assert problem(make_record(1), LIMITS) is None
    assert REASONS[how] in problem(spoil(make_record(1), how), LIMITS)


def test_unknown_labels_pass_and_class_probs_are_checked(make_record):
    rec = make_record(4)
    rec.objects_id[:] = UNKNOWN_LABEL  # imported without detector labels
    rec.objects_conf[:] = 0
    rec.class_probs = np.full((rec.num_boxes, 1601), 1 / 1601, np.float16)
    assert problem(rec, LIMITS) is None
    rec.class_probs[5, 7] = np.nan
    assert "class_probs(5, 7) is nan, not a probability" in problem(rec, LIMITS)
    rec.objects_id[0] = -2
    assert "objects_id[0] is -2" in problem(rec, LIMITS)


def test_boxes_may_overhang_by_the_slack(make_record):
    rec = make_record(2)
    rec.boxes[0] = [-1.5, 0, rec.img_w + 1.5, rec.img_h]  # 1 % of a >= 100 px side plus a pixel
    assert problem(rec, LIMITS) is None


def test_limits_follow_the_detector_in_the_provenance(make_record):
    rec = make_record(3)
    rec.objects_id[:] = 10
    meta = {"feature_dim": 64, "max_boxes": 36, "provenance": {"config": {"num_classes": 8}}}
    assert "outside 0..7" in problem(rec, RecordLimits.from_meta(meta))


def _write_raw(path, rec: RegionFeatures, how: str) -> None:
    """Store `rec` spoiled `how`, values the writer refuses (inf, NaN) included: spoiled in its encoded
    bytes, with a valid checksum, as faulty software upstream might have written it."""
    value = encode(rec, "float32")
    stored = spoil(decode(value), how)  # the arrays are views into `value`
    struct.pack_into("<II", value, 16, stored.img_h, stored.img_w)
    struct.pack_into("<I", value, CRC_OFFSET, checksum(value))
    env = lmdb.open(str(path), max_dbs=2)
    with env.begin(write=True) as txn:
        txn.put(rec.img_id.encode(), bytes(value), db=env.open_db(RECORDS_DB, txn=txn))
    env.close()


@pytest.fixture
def bad_store(tmp_path, make_record):
    """Records 0..5; 1 has an inf feature, 3 a zero image width, 4 an object label of 999999."""
    path = tmp_path / "s"
    with FeatureWriter(path, feature_dim=64, dtype="float32") as w:
        for i in (0, 2, 5):
            w.put(make_record(i))
    for i, how in ((1, "inf feature"), (3, "zero width"), (4, "object label")):
        _write_raw(path, make_record(i), how)
    FeatureWriter(path, feature_dim=64, dtype="float32").close()  # recounts the records
    return path


def test_the_store_round_trips_the_bad_values(bad_store):
    rec = FeatureReader(bad_store)["img_000001"]
    assert np.isinf(rec.features[3, 5])  # reads do not validate unless asked


def test_validating_reader_names_the_record_and_the_store(bad_store):
    reader = FeatureReader(bad_store, validate=True)
    assert reader["img_000000"].img_id == "img_000000"
    named = f"record 'img_000001' of store {bad_store}.*features.*--skip-bad"
    with pytest.raises(BadRecordError, match=named):
        reader["img_000001"]
    with pytest.raises(BadRecordError, match="'img_000003'.*image size 0x"):
        reader.get("img_000003")
    with reader.view() as v, pytest.raises(BadRecordError, match="'img_000004'.*999999"):
        v["img_000004"]


def test_skip_bad_logs_and_counts_each_record_once(bad_store, caplog):
    reader = FeatureReader(bad_store, skip_bad=True)
    with caplog.at_level(logging.WARNING, logger="storage.reader"):
        got = [reader.get(f"img_{i:06d}") for i in range(6)] + [reader.get("img_000001")]
    assert [r is not None for r in got] == [True, False, True, False, False, True, False]
    assert sorted(reader.skipped) == ["img_000001", "img_000003", "img_000004"]
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3
    assert all(m.startswith("skipping record 'img_00000") and str(bad_store) in m for m in logged)


def test_skip_bad_survives_pickling(bad_store):
    reader = pickle.loads(pickle.dumps(FeatureReader(bad_store, skip_bad=True)))
    assert reader.skip_bad and reader.get("img_000001") is None


def test_verify_deep_checks_values(bad_store, capsys):
    assert verify(bad_store).ok  # checksums and shapes are fine
    report = verify(bad_store, deep=True)
    assert [i for i, _ in report.bad] == ["img_000001", "img_000003", "img_000004"]
    assert main(["features", "verify", "--deep", str(bad_store)]) == 1
    out = capsys.readouterr().out
    assert "BAD img_000004: unusable values: objects_id[" in out and "6 records checked, 3 bad" in out
