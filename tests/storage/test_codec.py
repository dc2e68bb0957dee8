"""The record value format: every field and dtype round-trips, damage is detected, bad values refused."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from storage import codec
from storage.errors import CorruptRecordError


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("num_boxes,feature_dim", [(36, 2048), (1, 7), (0, 16), (100, 5)])
def test_every_field_round_trips(make_record, same, dtype, num_boxes, feature_dim):
    rec = make_record(3, num_boxes=num_boxes, feature_dim=feature_dim)
    value = codec.encode(rec, dtype)
    back = codec.decode(value, rec.img_id.encode())
    same(back, rec)
    assert back.features.dtype == np.dtype(dtype)
    assert back.features.shape == (num_boxes, feature_dim)
    assert back.objects_id.dtype == np.int64 and back.attrs_id.dtype == np.int64
    codec.check(value, rec.img_id.encode())


def test_float32_features_are_kept_exactly_and_float16_rounded(make_record):
    rec = make_record(1, num_boxes=4, feature_dim=8)
    rec.features = rec.features + np.float32(1e-3)
    np.testing.assert_array_equal(codec.decode(codec.encode(rec, "float32")).features, rec.features)
    np.testing.assert_array_equal(
        codec.decode(codec.encode(rec, "float16")).features, rec.features.astype(np.float16)
    )


def test_decoded_arrays_are_aligned_views_of_the_value(make_record):
    rec = make_record(2, num_boxes=5, feature_dim=3, img_id="odd-length-id")
    value = codec.encode(rec, "float16")
    back = codec.decode(value)
    base = np.frombuffer(value, np.uint8).ctypes.data
    for name in ("boxes", "features", "objects_id", "objects_conf", "attrs_id", "attrs_conf"):
        arr = getattr(back, name)
        assert np.shares_memory(arr, np.frombuffer(value, np.uint8)), name
        assert (arr.ctypes.data - base) % arr.dtype.itemsize == 0, name


def test_unicode_ids_and_wider_input_dtypes(make_record):
    rec = make_record(4, num_boxes=3, feature_dim=4, img_id="café/ünïcode 1.jpg")
    rec.boxes = rec.boxes.astype(np.float64)
    rec.objects_id = rec.objects_id.astype(np.int32)
    back = codec.decode(codec.encode(rec, "float32"))
    assert back.img_id == rec.img_id
    assert back.boxes.dtype == np.float32 and back.objects_id.dtype == np.int64
    np.testing.assert_array_equal(back.objects_id, rec.objects_id)


def test_a_flipped_byte_anywhere_fails_the_checksum(make_record):
    rec = make_record(5, num_boxes=2, feature_dim=4)
    value = codec.encode(rec, "float16")
    for pos in (17, codec.HEADER.size + 2, len(value) // 2, len(value) - 1):
        bad = bytearray(value)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptRecordError, match=rec.img_id):
            codec.check(bad, rec.img_id.encode())


def test_truncated_and_foreign_values_are_refused(make_record):
    value = codec.encode(make_record(6, num_boxes=2, feature_dim=4), "float16")
    with pytest.raises(CorruptRecordError, match="header describes"):
        codec.decode(value[:-2])
    with pytest.raises(CorruptRecordError, match="shorter than"):
        codec.decode(value[:10])
    with pytest.raises(CorruptRecordError, match="magic"):
        codec.decode(b"\x80\x04pickle" + bytes(40))
    newer = bytearray(value)
    struct.pack_into("<B", newer, 4, codec.LAYOUT_VERSION + 1)
    with pytest.raises(CorruptRecordError, match="upgrade xmodal"):
        codec.decode(newer)


def test_a_record_stored_under_another_key_is_caught(make_record):
    value = codec.encode(make_record(7, num_boxes=1, feature_dim=2), "float32")
    with pytest.raises(CorruptRecordError, match="carries img_id"):
        codec.check(value, b"someone_else")


@pytest.mark.parametrize("field", ["features", "boxes", "objects_conf"])
def test_non_finite_values_are_refused(make_record, field):
    rec = make_record(8, num_boxes=3, feature_dim=4)
    getattr(rec, field)[1, ...] = np.nan
    with pytest.raises(ValueError, match=field):
        codec.encode(rec, "float32")


def test_float16_overflow_names_the_fix(make_record):
    rec = make_record(9, num_boxes=2, feature_dim=4)
    rec.features[0, 0] = 1e6
    with pytest.raises(ValueError, match="float32"):
        codec.encode(rec, "float16")
    assert codec.decode(codec.encode(rec, "float32")).features[0, 0] == 1e6
