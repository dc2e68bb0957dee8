"""One record as bytes: a 32-byte little-endian header, the image id, then raw arrays (see FORMAT.md).

Layout 1 has no class distribution; layout 2 adds an 8-byte extension after the header (the number of
classes C) and the float16 (N, C) `class_probs` after the features. Records without class
probabilities are written in layout 1, so they stay byte-identical to older stores."""

from __future__ import annotations

import functools
import struct
import zlib

import numpy as np

from storage.errors import CorruptRecordError
from storage.records import CLASS_PROBS_DTYPE, RegionFeatures

MAGIC = b"XMRF"
LAYOUT_VERSION = 2  # the newest layout this code reads and writes
CLASS_PROBS_LAYOUT = 2  # the first layout with the class-distribution extension
# magic, layout version, feature dtype code, id length, num_boxes, feature_dim, img_h, img_w,
# value length, crc32 of the value without its crc field
HEADER = struct.Struct("<4sBBHIIIIII")
CRC_OFFSET = HEADER.size - 4
EXTENSION = struct.Struct("<II")  # layout 2: number of classes C (0 = no class_probs), reserved (0)
DTYPE_CODES = {"float16": 1, "float32": 2}
MAX_ID_BYTES = 511  # the longest image id, in UTF-8 bytes: LMDB's key limit, as the store's keys are ids
_CODE_DTYPES = {code: np.dtype(name).newbyteorder("<") for name, code in DTYPE_CODES.items()}
# (field, little-endian dtype, values per box) in storage order; features follow last
_FIXED_ARRAYS = (
    ("objects_id", np.dtype("<i8"), 1),
    ("attrs_id", np.dtype("<i8"), 1),
    ("boxes", np.dtype("<f4"), 4),
    ("objects_conf", np.dtype("<f4"), 1),
    ("attrs_conf", np.dtype("<f4"), 1),
)
_FLOAT16_OVERFLOW = 65520.0  # float32 values from here on round to inf in float16


def _id_span(id_len: int) -> int:
    """Bytes taken by the id, padded so every array starts 8-byte aligned."""
    return (id_len + 7) // 8 * 8


@functools.lru_cache(maxsize=1024)
def _layout(version: int, id_len: int, num_boxes: int, feature_dim: int, code: int, classes: int) -> tuple:
    """((field, shape, dtype, offset), ...) and the value size, for one record shape."""
    offset = HEADER.size + (EXTENSION.size if version >= CLASS_PROBS_LAYOUT else 0) + _id_span(id_len)
    fields = []
    for name, dt, per_box in _FIXED_ARRAYS:
        fields.append((name, (num_boxes, per_box) if per_box > 1 else (num_boxes,), dt, offset))
        offset += num_boxes * per_box * dt.itemsize
    feature_dtype = _CODE_DTYPES[code]
    fields.append(("features", (num_boxes, feature_dim), feature_dtype, offset))
    offset += num_boxes * feature_dim * feature_dtype.itemsize
    if classes:
        fields.append(("class_probs", (num_boxes, classes), CLASS_PROBS_DTYPE, offset))
        offset += num_boxes * classes * CLASS_PROBS_DTYPE.itemsize
    return tuple(fields), offset


def encode(rec: RegionFeatures, dtype: str = "float16") -> bytearray:
    """Serialise a validated record; features are cast to `dtype`, which must keep them finite."""
    key = rec.img_id.encode("utf-8")
    if len(key) > MAX_ID_BYTES:
        raise ValueError(
            f"record {rec.img_id!r}: img_id is {len(key)} bytes long; LMDB keys hold at most {MAX_ID_BYTES}"
        )
    n, d = rec.features.shape
    classes = rec.class_probs.shape[1] if rec.class_probs is not None else 0
    version = CLASS_PROBS_LAYOUT if classes else 1
    fields, size = _layout(version, len(key), n, d, DTYPE_CODES[dtype], classes)
    out = bytearray(size)
    id_at = HEADER.size
    if classes:
        EXTENSION.pack_into(out, HEADER.size, classes, 0)
        id_at += EXTENSION.size
    out[id_at : id_at + len(key)] = key
    for name, shape, dt, offset in fields:
        src = getattr(rec, name)
        if dt.kind == "f" and not np.isfinite(src).all():
            raise ValueError(f"record {rec.img_id!r}: {name} holds NaN or infinite values")
        if name == "features" and dtype == "float16" and n and src.dtype.itemsize > 2:
            peak = float(np.abs(src).max())
            if peak >= _FLOAT16_OVERFLOW:
                raise ValueError(
                    f"record {rec.img_id!r}: features reach {peak:g}, beyond float16 (65504): "
                    "use dtype='float32'"
                )
        np.ndarray(shape, dt, out, offset)[...] = src
    HEADER.pack_into(
        out,
        0,
        MAGIC,
        version,
        DTYPE_CODES[dtype],
        len(key),
        n,
        d,
        int(rec.img_h),
        int(rec.img_w),
        len(out),
        0,
    )
    struct.pack_into("<I", out, CRC_OFFSET, checksum(out))
    return out


def checksum(value) -> int:
    """crc32 of the whole value except the crc field itself."""
    mv = memoryview(value)
    return zlib.crc32(mv[HEADER.size :], zlib.crc32(mv[:CRC_OFFSET]))


def read_header(value, key: bytes | None = None) -> tuple:
    """Unpack and sanity-check the header: (dtype, id_len, num_boxes, feature_dim, img_h, img_w, crc)."""
    code, id_len, n, d, h, w, crc, _, _ = _parse_header(value, key)
    return _CODE_DTYPES[code], id_len, n, d, h, w, crc


def _parse_header(value, key: bytes | None) -> tuple:
    if len(value) < HEADER.size:
        raise CorruptRecordError(
            f"{_where(key)}: value is {len(value)} bytes, shorter than the {HEADER.size}-byte header"
        )
    magic, version, code, id_len, n, d, h, w, length, crc = HEADER.unpack_from(value, 0)
    if magic != MAGIC:
        raise CorruptRecordError(f"{_where(key)}: bad magic {magic!r}: not an xmodal record")
    if version > LAYOUT_VERSION:
        raise CorruptRecordError(
            f"{_where(key)}: record layout version {version} is newer than this xmodal reads "
            f"({LAYOUT_VERSION}): upgrade xmodal"
        )
    if code not in _CODE_DTYPES:
        raise CorruptRecordError(f"{_where(key)}: unknown feature dtype code {code}")
    classes, id_at = 0, HEADER.size
    if version >= CLASS_PROBS_LAYOUT:
        if len(value) < HEADER.size + EXTENSION.size:
            raise CorruptRecordError(f"{_where(key)}: value ends inside the layout {version} header")
        classes, _ = EXTENSION.unpack_from(value, HEADER.size)
        id_at += EXTENSION.size
    fields, expected = _layout(version, id_len, n, d, code, classes)
    if length != len(value) or expected != len(value):
        raise CorruptRecordError(
            f"{_where(key)}: value is {len(value)} bytes but its header describes {expected} "
            f"(recorded {length})"
        )
    return code, id_len, n, d, h, w, crc, fields, id_at


def _where(key: bytes | None) -> str:
    return f"record {key.decode('utf-8', 'replace')!r}" if key is not None else "record"


def decode(value, key: bytes | None = None) -> RegionFeatures:
    """Arrays are views into `value` (no copy): keep `value` alive and unchanged while they are used."""
    _, id_len, _, _, h, w, _, fields, id_at = _parse_header(value, key)
    img_id = bytes(value[id_at : id_at + id_len]).decode("utf-8")
    # np.ndarray over the buffer is a view like np.frombuffer, at a third of its call overhead
    return RegionFeatures(
        img_id, h, w, **{name: np.ndarray(shape, dt, value, offset) for name, shape, dt, offset in fields}
    )


def check(value, key: bytes) -> None:
    """Full integrity check of one stored value: header, checksum, id matches key, arrays decode."""
    *_, crc = read_header(value, key)
    actual = checksum(value)
    if actual != crc:
        raise CorruptRecordError(
            f"record {key.decode('utf-8', 'replace')!r}: checksum mismatch "
            f"(stored {crc:08x}, computed {actual:08x}): the value is corrupt"
        )
    try:
        rec = decode(value, key)
    except UnicodeDecodeError as exc:
        raise CorruptRecordError(f"record {key!r}: the embedded id is not UTF-8 ({exc})") from None
    if rec.img_id.encode("utf-8") != key:
        raise CorruptRecordError(f"record stored under {key!r} carries img_id {rec.img_id!r}")
