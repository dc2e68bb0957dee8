"""The value checks a run makes before training: in file order, pages requested first, and remembered per
store snapshot, so an unchanged store is not read again and a stopped check resumes."""

from __future__ import annotations

import logging
import struct

import numpy as np
import pytest

import storage.codec
import storage.reader
from storage import FeatureReader, FeatureWriter
from storage.checks import check_records
from storage.codec import CRC_OFFSET, checksum, encode
from storage.validate import BadRecordError

COUNT = 12
BAD = {"img_000003": "features(0, 5) is inf", "img_000008": "image size 0x"}


def spoiled(rec, how: str, dtype: str) -> bytes:
    """`rec` encoded with a bad value and a valid checksum, as faulty software might write it."""
    value = encode(rec, dtype)
    if how.startswith("features"):
        rec2 = storage.codec.decode(value)
        rec2.features[0, 5] = np.inf
    else:
        struct.pack_into("<II", value, 16, rec.img_h, 0)
    struct.pack_into("<I", value, CRC_OFFSET, checksum(value))
    return bytes(value)


def write(path, make_record, ids):
    with FeatureWriter(path, feature_dim=64) as w:
        for i in ids:
            rec = make_record(i)
            if rec.img_id in BAD:
                w.put_encoded(rec.img_id, spoiled(rec, BAD[rec.img_id], w.dtype))
            else:
                w.put(rec)


@pytest.fixture
def store(tmp_path, make_record):
    # written out of key order, so file order and key order differ
    path = tmp_path / "s"
    write(path, make_record, [7, 3, 11, 0, 9, 1, 5, 8, 2, 10, 4, 6])
    return path


@pytest.fixture
def decoded(monkeypatch):
    """The ids of the values decoded, in order."""
    seen: list[str] = []
    real = storage.codec.decode

    def decode(value, key=None):
        rec = real(value, key)
        seen.append(rec.img_id)
        return rec

    monkeypatch.setattr(storage.codec, "decode", decode)
    return seen


def ids(n=COUNT):
    return [f"img_{i:06d}" for i in range(n)]


def reference(path, wanted) -> dict[str, str]:
    """What a reader checking each record as it reads it skips: the checks made one by one."""
    reader = FeatureReader(path, validate=True, skip_bad=True)
    for img_id in wanted:
        reader.get(img_id)
    reader.close()
    return dict(reader.skipped)


def test_finds_what_reading_each_record_finds(store, tmp_path, caplog):
    want = reference(store, ids())
    assert {k: v[: len(BAD[k])] for k, v in want.items()} == BAD
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert check_records(FeatureReader(store), ids(), skip=True, cache=tmp_path / "memo") == want
    for img_id in BAD:
        assert sum(f"skipping record {img_id!r}" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(BadRecordError, match=r"record 'img_0000\d\d' of store .*s is unusable"):
        check_records(FeatureReader(store), ids(), skip=False, cache=None)


def test_an_unchanged_store_is_not_read_again(store, tmp_path, decoded, caplog):
    memo = tmp_path / "memo"
    first = check_records(FeatureReader(store), ids(), skip=True, cache=memo)
    assert sorted(decoded) == ids()
    decoded.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert check_records(FeatureReader(store), ids(), skip=True, cache=memo) == first
    assert decoded == []
    # the remembered bad records are still named, once each
    assert sum("skipping record" in r.getMessage() for r in caplog.records) == len(BAD)
    with pytest.raises(BadRecordError) as remembered:
        check_records(FeatureReader(store), ids(), skip=False, cache=memo)
    assert decoded == []
    with pytest.raises(BadRecordError) as read:
        check_records(FeatureReader(store), ids(), skip=False, cache=None)
    assert str(remembered.value) == str(read.value)


def test_only_records_not_checked_before_are_read(store, tmp_path, decoded):
    memo = tmp_path / "memo"
    want = reference(store, ids())
    check_records(FeatureReader(store), ids(6), skip=True, cache=memo)
    decoded.clear()
    assert check_records(FeatureReader(store), ids(), skip=True, cache=memo) == want
    assert sorted(decoded) == ids()[6:]


def test_a_changed_store_is_checked_again(store, tmp_path, decoded, make_record):
    memo = tmp_path / "memo"
    check_records(FeatureReader(store), ids(), skip=True, cache=memo)
    FeatureReader(store).close()
    write(store, make_record, [12])
    decoded.clear()
    check_records(FeatureReader(store), ids(13), skip=True, cache=memo)
    assert sorted(decoded) == ids(13)


def test_reads_in_file_order_after_requesting_the_pages(store, tmp_path, decoded, monkeypatch):
    requested: list[tuple[int, int]] = []
    monkeypatch.setattr(storage.reader, "request_ranges", lambda fd, ranges, *piece: requested.extend(ranges))
    # as on a cold store (this one was just written: its pages are in memory, so nothing would be asked)
    monkeypatch.setattr(storage.reader._Shard, "_in_memory", lambda self, spans: False)
    reader = FeatureReader(store)
    walk = reader.shards[0].tree()
    at = {k.decode(): walk.value_at[i] for i, k in enumerate(walk.keys)}
    check_records(reader, ids(), skip=True, cache=None)
    assert decoded == sorted(ids(), key=at.get) != ids()
    # every value's pages were asked for (the store is small: one batch, one request before any read)
    for img_id in ids():
        start = at[img_id]
        assert any(a <= start < a + n for a, n in requested), img_id


def test_a_stopped_check_resumes(store, tmp_path, monkeypatch):
    memo = tmp_path / "memo"
    want = reference(store, ids())
    monkeypatch.setattr("storage.checks.BATCH", 4)
    real = storage.codec.decode
    calls = []

    def stop_at_six(value, key=None):
        calls.append(key)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real(value, key)

    monkeypatch.setattr(storage.codec, "decode", stop_at_six)
    with pytest.raises(KeyboardInterrupt):
        check_records(FeatureReader(store), ids(), skip=True, cache=memo)
    seen = []
    monkeypatch.setattr(storage.codec, "decode", lambda value, key=None: seen.append(key) or real(value, key))
    assert check_records(FeatureReader(store), ids(), skip=True, cache=memo) == want
    assert len(seen) == COUNT - 5  # the five read before the stop are not read again


def test_a_damaged_memo_is_ignored(store, tmp_path, decoded, caplog):
    memo = tmp_path / "memo"
    want = reference(store, ids())
    check_records(FeatureReader(store), ids(), skip=True, cache=memo)
    for f in memo.iterdir():
        f.write_text('{"records": 12, "checked": "AAAA"')
    decoded.clear()
    with caplog.at_level(logging.WARNING):
        assert check_records(FeatureReader(store), ids(), skip=True, cache=memo) == want
    assert sorted(decoded) == ids()
    assert any("unreadable" in r.getMessage() for r in caplog.records)


def test_no_cache_keeps_nothing_and_missing_ids_are_left_out(store, tmp_path, monkeypatch):
    monkeypatch.setenv("XMODAL_CACHE", str(tmp_path / "home-cache"))
    assert check_records(FeatureReader(store), ["nope", *ids()], skip=True, cache=None).keys() == BAD.keys()
    assert not (tmp_path / "home-cache").exists()
    check_records(FeatureReader(store), ids(), skip=True)
    assert len(list((tmp_path / "home-cache" / "record-checks").iterdir())) == 1
