"""The metadata record of a feature store: format version, shapes, count and provenance (JSON)."""

from __future__ import annotations

import getpass
import json
import platform
import time
from pathlib import Path

from storage.errors import StoreFormatError
from storage.file_checks import parse_json

FORMAT_NAME = "xmodal-region-features"
# 2: records may carry `class_probs` (record layout 2); version 1 stores are read unchanged
FORMAT_VERSION = 2
CLASS_PROBS_FORMAT_VERSION = 2  # the first store version whose records may carry class_probs
RECORDS_DB = b"records"
META_DB = b"meta"
META_KEY = b"meta"
FEATURE_DTYPES = ("float16", "float32")
# far above any detector's (2048-d, 100 boxes), so that a damaged record cannot size an allocation
MAX_FEATURE_DIM, MAX_BOXES = 65536, 4096
MAX_IMAGE_SIDE = 1 << 20  # pixels; image sizes are stored as 32-bit integers


def new_meta(feature_dim: int, max_boxes: int, dtype: str, provenance: dict | None) -> dict:
    """The metadata of an empty store."""
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"dtype must be one of {FEATURE_DTYPES}, got {dtype!r}")
    if int(feature_dim) <= 0 or int(max_boxes) <= 0:
        raise ValueError(f"feature_dim and max_boxes must be positive, got {feature_dim} and {max_boxes}")
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "feature_dim": int(feature_dim),
        "dtype": dtype,
        "max_boxes": int(max_boxes),
        "count": 0,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "created_by": f"{_user()}@{platform.node()}",
        "provenance": dict(provenance or {}),
    }


def encode_meta(meta: dict) -> bytes:
    return json.dumps(meta, sort_keys=True).encode("utf-8")


def decode_meta(raw: bytes | None, path: str | Path) -> dict:
    """Parse and check a metadata record; a newer format version fails with a clear message."""
    if raw is None:
        raise StoreFormatError(f"{path}: no metadata record: not an xmodal feature store")
    meta = parse_json(
        raw, f"{path}: metadata record", f"the store is damaged; run `xmodal features verify {path}`"
    )
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise StoreFormatError(f"{path}: metadata describes a {found!r} store, not an {FORMAT_NAME} store")
    version = meta.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise StoreFormatError(f"{path}: invalid format_version {version!r} in the metadata record")
    if version > FORMAT_VERSION:
        raise StoreFormatError(
            f"{path}: written with store format version {version}, but this xmodal reads versions up to "
            f"{FORMAT_VERSION}; upgrade xmodal to read it"
        )
    for key in ("feature_dim", "dtype", "max_boxes", "count"):
        if key not in meta:
            raise StoreFormatError(f"{path}: metadata record lacks {key!r}: the store is damaged")
    for key, high in (("feature_dim", MAX_FEATURE_DIM), ("max_boxes", MAX_BOXES), ("count", None)):
        value = meta[key]
        low = 0 if key == "count" else 1
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
            allowed = f"an integer >= {low}" + (f" and <= {high}" if high else "")
            raise StoreFormatError(
                f"{path}: metadata record says {key}={value!r}, which must be {allowed}: the store is "
                f"damaged; run `xmodal features verify {path}`, then re-extract or re-import it"
            )
    if meta["dtype"] not in FEATURE_DTYPES:
        raise StoreFormatError(f"{path}: unknown feature dtype {meta['dtype']!r} in the metadata record")
    return meta


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"
