"""Write records parsed from a foreign file into a store: duplicates, bad rows, `skip_bad`, provenance."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from storage.errors import BadInputError, DroppedInput
from storage.records import RegionFeatures
from storage.writer import DEFAULT_FEATURE_DIM, FeatureWriter

log = logging.getLogger(__name__)
_BAD_KEPT_IN_META = 100
# Zero-box records carry no feature width: up to this many are held back until a record shows it.
_EMPTY_HELD_BACK = 10_000


@dataclass
class ImportReport:
    written: int = 0
    already_present: int = 0  # ids the store held before this run (a rerun resumes)
    unlabelled: int = 0  # records written without detector labels (UNKNOWN_LABEL ids)
    bad: list[str] = field(default_factory=list)  # one message per skipped line or row
    dropped: list[DroppedInput] = field(default_factory=list)  # what the source holds that no record has

    def summary(self, dst: str | os.PathLike) -> str:
        """One line: what was written, and what of the source was not."""
        line = (
            f"{dst}: {self.written} records written, {self.already_present} already present, "
            f"{len(self.bad)} bad skipped"
        )
        line += "".join(f", {note.count} {note.what}" for note in self.dropped if note.count)
        if self.unlabelled:
            line += f", {self.unlabelled} written without detector labels (stored as unknown)"
        return line


def import_records(
    items: Iterable[tuple[str, RegionFeatures | BadInputError]],
    src: str | os.PathLike,
    dst: str | os.PathLike,
    dtype: str = "float16",
    max_boxes: int = 36,
    feature_dim: int | None = None,
    skip_bad: bool = False,
    replace: bool = False,
    provenance: dict | None = None,
    source_provenance: dict | None = None,
    strict: bool = False,
) -> ImportReport:
    """`items` are (where, record or the error found at `where`). Stops at the first bad item unless
    `skip_bad`; records written before a stop stay committed, and a rerun skips them. What the source
    holds that no record carries (storage.errors.DroppedInput: ids naming no row, missing label datasets)
    is logged and kept in the report, or with `strict` refused (readers say it before any record). Without
    `feature_dim` the width is the first record with boxes' (zero-box records before it wait).
    `provenance` describes the import (under `imported_from`); `source_provenance`, what produced the
    features (an xmodal export's detector and configs), joins the store's own keys it does not have yet."""
    report = ImportReport()
    seen: dict[str, str] = {}
    held: list[tuple[str, RegionFeatures]] = []
    writer: FeatureWriter | None = None

    def bad(error: BadInputError) -> None:
        if not skip_bad:
            raise _stopped(error, report, dst)
        log.warning("skipped: %s", error)
        report.bad.append(str(error))

    def put(where: str, rec: RegionFeatures, dim: int) -> None:
        nonlocal writer
        checked = _check(rec, where, seen, dim, max_boxes)
        if isinstance(checked, BadInputError):
            bad(checked)
            return
        if writer is None:
            writer = FeatureWriter(dst, feature_dim=dim, max_boxes=max_boxes, dtype=dtype, replace=replace)
        try:
            written = writer.put(checked)
        except ValueError as exc:
            bad(BadInputError(f"{where}: {exc}"))
            return
        report.written += written
        report.already_present += not written
        report.unlabelled += written and not checked.labels_known

    def release_held(dim: int) -> None:
        for where, rec in held:
            put(where, rec, dim)
        held.clear()

    try:
        for where, item in items:
            if isinstance(item, DroppedInput):
                if strict:
                    raise BadInputError(
                        f"{item}; refused (--strict): fix the input, or import without --strict"
                    )
                log.warning("%s", item)
                report.dropped.append(item)
                continue
            if isinstance(item, BadInputError):
                bad(item)
                continue
            if writer is not None:
                put(where, item, writer.feature_dim)
            elif feature_dim is not None:
                put(where, item, feature_dim)
            elif item.num_boxes:
                release_held(item.feature_dim)
                put(where, item, item.feature_dim)
            else:
                held.append((where, item))
                if len(held) >= _EMPTY_HELD_BACK:
                    log.warning(
                        "%s: the first %d records have no boxes, so their feature width is unknown: "
                        "storing %d-d features (pass --feature-dim if that is wrong)",
                        src,
                        len(held),
                        DEFAULT_FEATURE_DIM,
                    )
                    release_held(DEFAULT_FEATURE_DIM)
        release_held(DEFAULT_FEATURE_DIM)  # only zero-box records wait, and only when no width was given
        if writer is None:
            if feature_dim is None:
                raise BadInputError(f"{src}: no valid record to import (nothing written)")
            writer = FeatureWriter(
                dst, feature_dim=feature_dim, max_boxes=max_boxes, dtype=dtype, replace=replace
            )
        if source_provenance:
            kept = writer.meta["provenance"]
            writer.update_meta({k: v for k, v in source_provenance.items() if k not in kept})
        labels = (
            "absent" if report.unlabelled == report.written else "partial" if report.unlabelled else "present"
        )
        writer.update_meta(
            {
                "imported_from": {
                    "path": str(Path(src).resolve()),
                    "written": report.written,
                    "already_present": report.already_present,
                    "skipped_bad": len(report.bad),
                    "bad": report.bad[:_BAD_KEPT_IN_META],
                    "labels": labels if report.written else "none written",
                    **(provenance or {}),
                }
            }
        )
        if report.unlabelled:
            # kept across imports: how many records of the store carry no detector labels
            before = writer.meta["provenance"].get("unlabelled_records", 0)
            writer.update_meta({"unlabelled_records": before + report.unlabelled})
    finally:
        if writer is not None:
            writer.close()
    return report


def _stopped(bad: BadInputError, report: ImportReport, dst: str | os.PathLike) -> BadInputError:
    return BadInputError(
        f"{bad}; the {report.written} records before it were written to {dst} (a rerun skips them); "
        "fix the input or rerun with --skip-bad"
    )


def _check(
    rec: RegionFeatures, where: str, seen: dict[str, str], feature_dim: int, max_boxes: int
) -> RegionFeatures | BadInputError:
    """The record, its zero-box features reshaped to the set's width, or the error that makes it bad."""
    if rec.img_id in seen:
        return BadInputError(f"{where}: duplicate id {rec.img_id!r}, first seen at {seen[rec.img_id]}")
    if rec.num_boxes == 0:
        rec.features = np.zeros((0, feature_dim), np.float32)
    try:
        rec.validate(feature_dim=feature_dim, max_boxes=max_boxes)
    except ValueError as exc:
        return BadInputError(f"{where}: {exc}")
    seen[rec.img_id] = where
    return rec
