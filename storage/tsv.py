"""Feature TSVs: LXMERT's ten fields and bottom-up-attention's six (`generate_tsv.py`), no header, arrays
as base64 of little-endian bytes; the layout is told by the field count of the first line."""

from __future__ import annotations

import base64
import binascii
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from storage.errors import BadInputError
from storage.metadata import MAX_BOXES, MAX_IMAGE_SIDE
from storage.reader import FeatureReader
from storage.records import UNKNOWN_LABEL, RegionFeatures

log = logging.getLogger(__name__)
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
# bottom-up-attention's tools/generate_tsv.py: width before height, no detector labels
BUTD_TSV_FIELDS = ("img_id", "img_w", "img_h", "num_boxes", "boxes", "features")
LAYOUTS = {
    len(TSV_FIELDS): ("lxmert", TSV_FIELDS),
    len(BUTD_TSV_FIELDS): ("bottom-up-attention", BUTD_TSV_FIELDS),
}
# base64 field: (dtype, values per box; 0 = the feature width, inferred)
_ARRAYS = {
    "objects_id": (np.dtype("<i8"), 1),
    "objects_conf": (np.dtype("<f4"), 1),
    "attrs_id": (np.dtype("<i8"), 1),
    "attrs_conf": (np.dtype("<f4"), 1),
    "boxes": (np.dtype("<f4"), 4),
    "features": (np.dtype("<f4"), 0),
}


def tsv_layout(path: str | os.PathLike) -> str:
    """ "lxmert" (10 fields) or "bottom-up-attention" (6 fields), from the first non-blank line."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                fields = line.rstrip(b"\r\n").split(b"\t")
                return _layout_of(fields, _where(path, lineno, fields))[0]
    raise BadInputError(f"{path}: the file is empty")


def tsv_max_boxes(path: str | os.PathLike) -> int:
    """The most boxes a line has (its num_boxes field), so that a 10-100 box file is not cut to a
    default width; one pass reading only that field. Malformed lines are left to `read_tsv` to name."""
    most, index = 1, None
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            fields = line.rstrip(b"\r\n").split(b"\t", 8)
            if index is None:
                names = LAYOUTS.get(line.count(b"\t") + 1, (None, ()))[1]
                if "num_boxes" not in names:
                    return most
                index = names.index("num_boxes")
            digits = fields[index].strip() if len(fields) > index else b""
            # a count past what a store holds (5,000 digits, say) is left to `read_tsv` to name with its line
            if digits.isdigit() and len(digits) <= 9 and int(digits) <= MAX_BOXES:
                most = max(most, int(digits))
    return most


def _layout_of(fields: list[bytes], where: str) -> tuple[str, tuple[str, ...]]:
    if len(fields) not in LAYOUTS:
        expected = "; ".join(
            f"{len(names)} for {name} ({', '.join(names)})" for name, names in LAYOUTS.values()
        )
        raise BadInputError(
            f"{where}: {len(fields)} tab-separated fields, an unknown feature TSV layout; expected {expected}"
        )
    return LAYOUTS[len(fields)]


def _where(path: str | os.PathLike, lineno: int, fields: list[bytes]) -> str:
    return f"{path} line {lineno} (id {fields[0].decode('utf-8', 'replace')!r})"


def read_tsv(path: str | os.PathLike) -> Iterator[tuple[str, RegionFeatures | BadInputError]]:
    """Stream (where, record or error) line by line; blank lines are skipped like csv.DictReader does.
    The first line fixes the layout; bottom-up-attention records get UNKNOWN_LABEL ids at confidence 0."""
    names: tuple[str, ...] | None = None
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip(b"\r\n")
            if not line.strip():
                continue
            fields = line.split(b"\t")
            where = _where(path, lineno, fields)
            if names is None:
                names = _layout_of(fields, where)[1]
            if len(fields) != len(names):
                hint = " (truncated line?)" if len(fields) < len(names) else ""
                yield (
                    where,
                    BadInputError(
                        f"{where}: expected {len(names)} tab-separated fields, got {len(fields)}{hint} "
                        f"(the file's first line has {len(names)})"
                    ),
                )
                continue
            try:
                yield where, _parse(dict(zip(names, fields, strict=True)))
            except (BadInputError, ValueError, UnicodeDecodeError) as exc:
                yield where, BadInputError(f"{where}: {exc}")


def _parse(fields: dict[str, bytes]) -> RegionFeatures:
    ints = {}
    for name in ("img_h", "img_w", "num_boxes"):
        try:
            ints[name] = int(fields[name])
        except ValueError:
            raise BadInputError(f"field {name} is {fields[name][:20]!r}, not an integer") from None
    # the row's schema: counts and sizes a store can hold, checked before they size an allocation
    for name, low, high in (
        ("img_h", 0, MAX_IMAGE_SIDE),
        ("img_w", 0, MAX_IMAGE_SIDE),
        ("num_boxes", 0, MAX_BOXES),
    ):
        if not low <= ints[name] <= high:
            raise BadInputError(f"field {name} is {ints[name]}, outside [{low}, {high}]")
    n = ints["num_boxes"]
    arrays = {}
    for name, (dtype, per_box) in _ARRAYS.items():
        if name not in fields:
            # bottom-up-attention's layout: the labels are unknown, not class 0
            unknown = np.full(n, UNKNOWN_LABEL, np.int64) if dtype.kind == "i" else np.zeros(n, np.float32)
            arrays[name] = unknown
            continue
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


def export_tsv(src: FeatureReader, dst: str | os.PathLike, skip_empty: bool = False) -> int:
    """Write every record as the LXMERT loader reads it (features float32); atomically renamed at the end.

    A record without boxes is refused (LXMERT's loader cannot reshape its empty features), or skipped
    with a warning when `skip_empty`. Returns the number of records written."""
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".partial")
    count, skipped = 0, []
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for img_id in src:
                if any(c in img_id for c in "\t\r\n") or img_id.startswith('"'):
                    raise ValueError(
                        f"record {img_id!r}: an id with tabs, newlines or a leading quote cannot go in a TSV"
                    )
                rec = src[img_id]
                if not rec.num_boxes:
                    if not skip_empty:
                        raise ValueError(
                            f"record {img_id!r} has no boxes, which LXMERT's TSV loader cannot read "
                            f"(nothing written to {dst}); rerun with --skip-empty to leave such records out"
                        )
                    log.warning("record %r has no boxes: left out of %s", img_id, dst)
                    skipped.append(img_id)
                    continue
                f.write(format_line(rec))
                count += 1
    except BaseException:
        tmp.unlink(missing_ok=True)  # a damaged record, an interrupt: no half-written file is left
        raise
    os.replace(tmp, dst)
    if skipped:
        log.warning("%s: %d records without boxes left out (first: %r)", dst, len(skipped), skipped[0])
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
