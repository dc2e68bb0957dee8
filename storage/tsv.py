"""The LXMERT feature TSV: no header, ten tab-separated fields, arrays as base64 of little-endian bytes."""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from storage.errors import BadInputError
from storage.reader import FeatureReader
from storage.records import RegionFeatures

TSV_FIELDS = (
    "img_id",
    "img_h",
    "img_w",
    "objects_id",
    "objects_conf",
    "attrs_id",
    "attrs_conf",
    "num_boxes",
    "boxes",
    "features",
)
# base64 field: (dtype, values per box; 0 = the feature width, inferred)
_ARRAYS = {
    "objects_id": (np.dtype("<i8"), 1),
    "objects_conf": (np.dtype("<f4"), 1),
    "attrs_id": (np.dtype("<i8"), 1),
    "attrs_conf": (np.dtype("<f4"), 1),
    "boxes": (np.dtype("<f4"), 4),
    "features": (np.dtype("<f4"), 0),
}


def read_tsv(path: str | os.PathLike) -> Iterator[tuple[str, RegionFeatures | BadInputError]]:
    """Stream (where, record or error) line by line; blank lines are skipped like csv.DictReader does."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip(b"\r\n")
            if not line.strip():
                continue
            fields = line.split(b"\t")
            img_id = fields[0].decode("utf-8", "replace")
            where = f"{path} line {lineno} (id {img_id!r})"
            if len(fields) != len(TSV_FIELDS):
                hint = " (truncated line?)" if len(fields) < len(TSV_FIELDS) else ""
                yield (
                    where,
                    BadInputError(
                        f"{where}: expected {len(TSV_FIELDS)} tab-separated fields, got {len(fields)}{hint}"
                    ),
                )
                continue
            try:
                yield where, _parse(dict(zip(TSV_FIELDS, fields, strict=True)))
            except (BadInputError, ValueError, UnicodeDecodeError) as exc:
                yield where, BadInputError(f"{where}: {exc}")


def _parse(fields: dict[str, bytes]) -> RegionFeatures:
    ints = {}
    for name in ("img_h", "img_w", "num_boxes"):
        try:
            ints[name] = int(fields[name])
        except ValueError:
            raise BadInputError(f"field {name} is {fields[name][:20]!r}, not an integer") from None
    n = ints["num_boxes"]
    if n < 0:
        raise BadInputError(f"num_boxes is negative ({n})")
    arrays = {}
    for name, (dtype, per_box) in _ARRAYS.items():
        try:
            raw = base64.b64decode(fields[name], validate=True)
        except binascii.Error as exc:
            raise BadInputError(f"field {name} is not valid base64 ({exc})") from None
        if per_box:
            ok = len(raw) == n * per_box * dtype.itemsize
            expected = f"{n * per_box * dtype.itemsize} ({n} x {per_box} {dtype.name})"
        else:
            ok = len(raw) > 0 and len(raw) % (n * dtype.itemsize) == 0 if n else not raw
            expected = f"a positive multiple of {n * dtype.itemsize} ({n} rows of {dtype.name})"
        if not ok:
            raise BadInputError(f"field {name}: base64 decodes to {len(raw)} bytes, expected {expected}")
        arr = np.frombuffer(raw, dtype=dtype)
        arrays[name] = arr if per_box == 1 else arr.reshape(n, per_box if per_box or not n else -1)
    return RegionFeatures(
        img_id=fields["img_id"].decode("utf-8"), img_h=ints["img_h"], img_w=ints["img_w"], **arrays
    )


def export_tsv(src: FeatureReader, dst: str | os.PathLike) -> int:
    """Write every record as the LXMERT loader reads it (features float32); atomically renamed at the end."""
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    count = 0
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for img_id in src:
            if any(c in img_id for c in "\t\r\n") or img_id.startswith('"'):
                tmp.unlink()
                raise ValueError(
                    f"record {img_id!r}: an id with tabs, newlines or a leading quote cannot go in a TSV"
                )
            f.write(format_line(src[img_id]))
            count += 1
    os.replace(tmp, dst)
    return count


def format_line(rec: RegionFeatures) -> str:
    """One TSV line, newline included."""

    def b64(arr: np.ndarray, dtype: str) -> str:
        return base64.b64encode(np.ascontiguousarray(arr, dtype=dtype).tobytes()).decode("ascii")

    fields = (
        rec.img_id,
        str(int(rec.img_h)),
        str(int(rec.img_w)),
        b64(rec.objects_id, "<i8"),
        b64(rec.objects_conf, "<f4"),
        b64(rec.attrs_id, "<i8"),
        b64(rec.attrs_conf, "<f4"),
        str(rec.num_boxes),
        b64(rec.boxes, "<f4"),
        b64(rec.features, "<f4"),
    )
    return "\t".join(fields) + "\n"
