"""The optional per-region class distribution: layout 2 records, store format 2, older stores still read."""

from __future__ import annotations

import json
import struct
import zlib

import lmdb
import numpy as np
import pytest

from storage import FeatureReader, FeatureWriter, codec
from storage.metadata import META_DB, META_KEY
from storage.records import UNKNOWN_LABEL


def with_probs(rec, classes=1601, seed=0):
    """`rec` with a softmax distribution per region, as the detector gives it."""
    logits = np.random.default_rng(seed).normal(size=(rec.num_boxes, classes))
    probs = np.exp(logits - logits.max(1, keepdims=True))
    rec.class_probs = (probs / probs.sum(1, keepdims=True)).astype(np.float32)
    return rec


def test_a_record_without_class_probs_keeps_the_version_1_bytes(make_record):
    rec = make_record(0, num_boxes=36, feature_dim=2048, img_id="x" * 8)
    value = codec.encode(rec, "float16")
    # FORMAT.md: 32-byte header + padded id + 40 N + N D 2, layout version byte 1
    assert len(value) == 148_928 + 8 and value[4] == 1
    # decoded by hand from the documented version 1 layout, not through the codec
    n, d = struct.unpack_from("<II", value, 8)
    assert (n, d) == (36, 2048)
    feats = np.frombuffer(value, "<f2", n * d, 32 + 8 + 40 * n).reshape(n, d)
    np.testing.assert_array_equal(feats, rec.features.astype(np.float16))
    assert codec.decode(value).class_probs is None


@pytest.mark.parametrize("num_boxes", [36, 1, 0])
def test_class_probs_round_trip_in_layout_2(make_record, same, num_boxes):
    rec = with_probs(make_record(1, num_boxes=num_boxes, feature_dim=16))
    value = codec.encode(rec, "float16")
    assert value[4] == 2
    # the documented layout 2: an 8-byte extension holding C after the header, class_probs after features
    assert struct.unpack_from("<II", value, 32) == (1601, 0)
    id_span = 16  # "img_000001" padded to a multiple of 8
    assert len(value) == 32 + 8 + id_span + 40 * num_boxes + num_boxes * 16 * 2 + num_boxes * 1601 * 2
    tail = np.frombuffer(value, "<f2", num_boxes * 1601, len(value) - num_boxes * 1601 * 2)
    np.testing.assert_array_equal(tail.reshape(num_boxes, 1601), rec.class_probs.astype(np.float16))
    back = codec.decode(value, rec.img_id.encode())
    same(back, rec)
    assert back.class_probs.dtype == np.float16 and back.class_probs.shape == (num_boxes, 1601)
    codec.check(value, rec.img_id.encode())
    damaged = bytearray(value)
    damaged[-1] ^= 0xFF
    with pytest.raises(Exception, match="checksum"):
        codec.check(damaged, rec.img_id.encode())


@pytest.mark.parametrize(
    ("probs", "match"),
    [
        (np.full((3, 5), 2.0, np.float32), "probabilities"),
        (np.full((3, 5), -0.1, np.float32), "probabilities"),
        (np.full((2, 5), 0.2, np.float32), r"shape \(2, 5\) for 3 boxes"),
        (np.full((3,), 0.2, np.float32), "N x classes"),
        (np.full((3, 5), 1, np.int64), "N x classes"),
    ],
)
def test_bad_class_probs_are_refused_by_name(make_record, probs, match):
    rec = make_record(2, num_boxes=3, feature_dim=4)
    rec.class_probs = probs
    with pytest.raises(ValueError, match=rf"record 'img_000002'.*{match}"):
        rec.validate()


def _set_meta_version(path, version):
    env = lmdb.open(str(path), max_dbs=2)
    db = env.open_db(META_DB)
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(META_KEY, db=db))
        meta["format_version"] = version
        txn.put(META_KEY, json.dumps(meta).encode(), db=db)
    env.close()


def test_writer_and_reader_round_trip_and_a_version_1_store_still_reads(tmp_path, make_record, same):
    plain = make_record(3, num_boxes=5, feature_dim=8)
    with FeatureWriter(tmp_path / "s", feature_dim=8) as w:
        w.put(plain)
    _set_meta_version(tmp_path / "s", 1)  # a store written before class_probs existed
    r = FeatureReader(tmp_path / "s")
    assert r.meta["format_version"] == 1
    got = r[plain.img_id]
    same(got, plain)
    assert got.class_probs is None
    r.close()

    rich = with_probs(make_record(4, num_boxes=7, feature_dim=8), classes=11)
    with FeatureWriter(tmp_path / "s", feature_dim=8) as w:
        w.put(rich)
    r = FeatureReader(tmp_path / "s")
    assert r.meta["format_version"] == 2  # it now holds a record older readers must refuse
    got = r[rich.img_id]
    np.testing.assert_array_equal(got.class_probs, rich.class_probs.astype(np.float16))
    assert r[plain.img_id].class_probs is None
    with r.view() as v:
        np.testing.assert_array_equal(v[rich.img_id].class_probs, rich.class_probs.astype(np.float16))
    r.close()


def test_labels_known_tells_unknown_labels_apart(make_record):
    rec = make_record(5, num_boxes=4)
    assert rec.labels_known
    rec.objects_id = np.full(4, UNKNOWN_LABEL, np.int64)
    assert not rec.labels_known
    assert make_record(6, num_boxes=0).labels_known  # nothing to label


def test_a_corrupt_extension_is_named(make_record):
    value = codec.encode(with_probs(make_record(7, num_boxes=2, feature_dim=4), classes=3), "float32")
    bad = bytearray(value)
    struct.pack_into("<I", bad, 32, 4)  # claims 4 classes: the length no longer adds up
    struct.pack_into(
        "<I",
        bad,
        codec.CRC_OFFSET,
        zlib.crc32(bytes(bad[codec.HEADER.size :]), zlib.crc32(bytes(bad[: codec.CRC_OFFSET]))),
    )
    with pytest.raises(Exception, match="header describes"):
        codec.decode(bad)
