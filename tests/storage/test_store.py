"""FeatureWriter and FeatureReader: round trips, resume, map growth, refusals, shards, versions."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import lmdb
import numpy as np
import pytest

from storage import FeatureReader, FeatureWriter, StoreError, StoreFormatError
from storage.metadata import FORMAT_VERSION, META_DB, META_KEY


def write(path, records, **kw):
    kw.setdefault("feature_dim", records[0].feature_dim if records else 64)
    with FeatureWriter(path, **kw) as w:
        return [w.put(r) for r in records]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_round_trip_through_a_store(tmp_path, make_record, same, dtype):
    recs = [make_record(i, num_boxes=i % 37) for i in range(40)]
    assert all(write(tmp_path / "s", recs, dtype=dtype, meta={"detector": "vg-r101-c4"}))
    r = FeatureReader(tmp_path / "s")
    assert len(r) == 40
    assert list(r.keys()) == sorted(rec.img_id for rec in recs)
    for rec in recs:
        assert rec.img_id in r
        got = r[rec.img_id]
        same(got, rec)
        assert got.features.dtype == np.dtype(dtype)
        assert got.features.flags.writeable
    assert "nope" not in r and r.get("nope") is None
    with pytest.raises(KeyError):
        r["nope"]
    meta = r.meta
    assert (meta["count"], meta["feature_dim"], meta["dtype"], meta["max_boxes"]) == (40, 64, dtype, 36)
    assert meta["format_version"] == FORMAT_VERSION and meta["provenance"] == {"detector": "vg-r101-c4"}
    assert (r.feature_dim, r.max_boxes) == (64, 36)


def test_existing_ids_are_skipped_unless_replace(tmp_path, make_record, same):
    old, new = make_record(1), make_record(2, img_id="img_000001")
    assert write(tmp_path / "s", [old, new]) == [True, False]
    same(FeatureReader(tmp_path / "s")["img_000001"], old)
    assert write(tmp_path / "s", [new], replace=True) == [True]
    r = FeatureReader(tmp_path / "s")
    same(r["img_000001"], new)
    assert len(r) == 1 and r.meta["count"] == 1


def test_reopening_appends_and_keeps_provenance(tmp_path, make_record):
    write(tmp_path / "s", [make_record(i) for i in range(3)], meta={"a": 1})
    with FeatureWriter(tmp_path / "s", feature_dim=64, meta={"b": 2}) as w:
        assert len(w) == 3 and "img_000002" in w and "img_000003" not in w
        assert w.put(make_record(3)) and not w.put(make_record(0))
        w.update_meta({"c": 3})
    r = FeatureReader(tmp_path / "s")
    assert len(r) == 4 and r.meta["count"] == 4
    assert r.meta["provenance"] == {"a": 1, "b": 2, "c": 3}


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"feature_dim": 32}, "feature_dim"),
        ({"max_boxes": 100}, "max_boxes"),
        ({"dtype": "float32"}, "dtype"),
    ],
)
def test_reopening_with_other_shapes_is_refused(tmp_path, make_record, kw, match):
    write(tmp_path / "s", [make_record(0)])
    with pytest.raises(ValueError, match=match):
        FeatureWriter(tmp_path / "s", **{"feature_dim": 64, **kw})


def _break(rec, how):
    if how == "boxes_n_by_3":
        rec.boxes = rec.boxes[:, :3]
    elif how == "feature_dim":
        rec.features = rec.features[:, :10]
    elif how == "row_count":
        rec.objects_conf = rec.objects_conf[:-1]
    elif how == "float_ids":
        rec.objects_id = rec.objects_id.astype(np.float32)
    elif how == "int_features":
        rec.features = rec.features.astype(np.int32)
    elif how == "list_boxes":
        rec.boxes = rec.boxes.tolist()
    elif how == "too_many_boxes":
        return None
    elif how == "nan":
        rec.attrs_conf[0] = np.nan
    elif how == "zero_size":
        rec.img_w = 0
    return rec


@pytest.mark.parametrize(
    "how",
    [
        "boxes_n_by_3",
        "feature_dim",
        "row_count",
        "float_ids",
        "int_features",
        "list_boxes",
        "too_many_boxes",
        "nan",
        "zero_size",
    ],
)
def test_wrong_shapes_and_dtypes_are_refused_before_writing(tmp_path, make_record, how):
    rec = _break(make_record(5), how) or make_record(5, num_boxes=37)
    with FeatureWriter(tmp_path / "s", feature_dim=64) as w:
        w.put(make_record(0))
        with pytest.raises(ValueError, match="img_000005"):
            w.put(rec)
        assert "img_000005" not in w
    r = FeatureReader(tmp_path / "s")
    assert list(r.keys()) == ["img_000000"] and r.meta["count"] == 1


def test_map_grows_from_a_tiny_initial_map(tmp_path, make_record, same):
    recs = [make_record(i, feature_dim=2048) for i in range(30)]  # ~150 KB each, 4.4 MB in all
    with FeatureWriter(tmp_path / "s", feature_dim=2048, map_size=64 << 10, commit_every=7) as w:
        for rec in recs:
            assert w.put(rec)
    r = FeatureReader(tmp_path / "s")
    assert len(r) == 30 and r.meta["count"] == 30
    for rec in recs:
        same(r[rec.img_id], rec, np.float16)


def test_one_record_larger_than_the_whole_map(tmp_path, make_record, same):
    rec = make_record(0, num_boxes=100, feature_dim=4096)
    with FeatureWriter(
        tmp_path / "s", feature_dim=4096, max_boxes=100, dtype="float32", map_size=32 << 10
    ) as w:
        assert w.put(rec)
    same(FeatureReader(tmp_path / "s")[rec.img_id], rec)


def _set_version(path, version):
    env = lmdb.open(str(path), max_dbs=2)
    db = env.open_db(META_DB)
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(META_KEY, db=db))
        meta["format_version"] = version
        txn.put(META_KEY, json.dumps(meta).encode(), db=db)
    env.close()


def test_unknown_future_version_fails_clearly(tmp_path, make_record):
    write(tmp_path / "s", [make_record(0)])
    _set_version(tmp_path / "s", FORMAT_VERSION + 1)
    r = FeatureReader(tmp_path / "s")  # lazy: nothing opened yet
    with pytest.raises(StoreFormatError, match=rf"version {FORMAT_VERSION + 1}.*upgrade xmodal"):
        len(r)
    with pytest.raises(StoreFormatError, match="upgrade xmodal"):
        FeatureWriter(tmp_path / "s", feature_dim=64)


def test_paths_that_are_not_stores(tmp_path):
    with pytest.raises(FileNotFoundError, match="no feature store"):
        len(FeatureReader(tmp_path / "missing"))
    env = lmdb.open(str(tmp_path / "plain"))
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    with pytest.raises(StoreFormatError, match="not an xmodal feature store"):
        len(FeatureReader(tmp_path / "plain"))


def test_shards_read_as_one(tmp_path, make_record, same):
    a = [make_record(i) for i in range(0, 10)]
    b = [make_record(i, num_boxes=50) for i in range(10, 15)]
    write(tmp_path / "a", a)
    write(tmp_path / "b", b, max_boxes=100)
    r = FeatureReader([tmp_path / "a", str(tmp_path / "b")])
    assert len(r) == 15 and r.meta["count"] == 15 and r.max_boxes == 100
    assert list(r.keys()) == [x.img_id for x in a + b]
    for rec in a + b:
        same(r[rec.img_id], rec, np.float16)
    write(tmp_path / "c", [make_record(99, feature_dim=8)])
    with pytest.raises(StoreFormatError, match="feature_dim"):
        len(FeatureReader([tmp_path / "a", tmp_path / "c"]))


def test_reader_pickles_without_its_handles(tmp_path, make_record, same):
    write(tmp_path / "s", [make_record(0)])
    r = FeatureReader(tmp_path / "s")
    assert len(r) == 1
    clone = pickle.loads(pickle.dumps(r))
    assert clone._shards == []
    same(clone["img_000000"], make_record(0), np.float16)


def test_view_reads_without_copying(tmp_path, make_record, same):
    recs = [make_record(i) for i in range(3)]
    write(tmp_path / "s", recs)
    r = FeatureReader(tmp_path / "s")
    with r.view() as v:
        for rec in recs:
            got = v[rec.img_id]
            same(got, rec, np.float16)
            assert not got.features.flags.writeable
        with pytest.raises(KeyError):
            v["nope"]


def test_keys_span_several_read_transactions(tmp_path, make_record, monkeypatch):
    import storage.reader

    monkeypatch.setattr(storage.reader, "_KEYS_PER_TXN", 3)
    write(tmp_path / "s", [make_record(i, num_boxes=1) for i in range(10)])
    assert list(FeatureReader(tmp_path / "s").keys()) == [f"img_{i:06d}" for i in range(10)]


def test_reading_writes_no_lock_file(tmp_path, make_record, same):
    write(tmp_path / "s", [make_record(0)])
    (tmp_path / "s" / "lock.mdb").unlink()
    r = FeatureReader(tmp_path / "s")
    same(r["img_000000"], make_record(0), np.float16)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["data.mdb"]


def test_storage_imports_no_torch(repo_root):
    code = (
        "import sys, storage, storage.tsv, storage.hdf5, storage.importer, storage.merge, storage.verify, "
        "storage.info; bad = [m for m in ('torch', 'extraction', 'model', 'pipelines') if m in sys.modules]; "
        "sys.exit(str(bad) if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_lock_true_after_a_lock_free_reader_reads_with_the_lock(tmp_path, make_record, same, monkeypatch):
    import storage.reader

    monkeypatch.setattr(storage.reader, "_KEYS_PER_TXN", 2)
    recs = [make_record(i, num_boxes=1) for i in range(5)]
    write(tmp_path / "s", recs)
    free = FeatureReader(tmp_path / "s")
    keys = free.keys()
    assert next(keys) == "img_000000" and not free.shards[0].env.flags()["lock"]
    locked = FeatureReader(tmp_path / "s", lock=True)
    same(locked["img_000001"], recs[1], np.float16)
    assert locked.shards[0].env.flags()["lock"]
    # the lock-free reader, mid-iteration, goes on through the one environment this process may hold
    assert list(keys) == [rec.img_id for rec in recs[1:]]
    same(free["img_000004"], recs[4], np.float16)
    assert free.shards[0].env is locked.shards[0].env
    assert FeatureReader(tmp_path / "s").shards[0].env.flags()["lock"]


def test_lock_true_while_a_lock_free_view_is_open_is_refused(tmp_path, make_record):
    write(tmp_path / "s", [make_record(0)])
    with FeatureReader(tmp_path / "s").view() as v:
        with pytest.raises(StoreError, match="view"):
            len(FeatureReader(tmp_path / "s", lock=True))
        assert v["img_000000"].num_boxes == 36
    assert len(FeatureReader(tmp_path / "s", lock=True)) == 1


def test_closing_or_writing_a_store_under_an_open_view_is_refused(tmp_path, make_record):
    """The view's arrays point into the environment's map: nothing in this process may close it."""
    write(tmp_path / "s", [make_record(0)])
    with FeatureReader(tmp_path / "s").view() as v:
        with pytest.raises(StoreError, match="view"):
            FeatureReader(tmp_path / "s").close()
        with pytest.raises(StoreError, match="view"):
            FeatureWriter(tmp_path / "s")
        assert v["img_000000"].num_boxes == 36
    FeatureReader(tmp_path / "s").close()
