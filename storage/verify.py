"""Whole-store integrity check: the B-tree's pages are sound, every record decodes, matches its checksum and
fits the store's shapes, and (deep) holds values a model can use."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from storage import codec
from storage.btree import BrokenPage
from storage.environment import StoreDamagedError
from storage.errors import CorruptRecordError
from storage.reader import FeatureReader
from storage.salvage import salvage
from storage.shards import expand
from storage.validate import RecordLimits, problem

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    checked: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (img_id, reason)
    problems: list[str] = field(default_factory=list)  # store-level problems (broken pages, count mismatch)
    damaged: list[str] = field(default_factory=list)  # stores with broken pages

    @property
    def ok(self) -> bool:
        return not self.bad and not self.problems


def verify(
    paths: str | os.PathLike | Sequence[str | os.PathLike], progress_every: int = 10000, deep: bool = False
) -> VerifyReport:
    """Check every page and record of one store or several shards; never raises on a bad record or a
    broken page, reports it. `deep` also checks each record's values (storage.validate). A store lmdb
    refuses to open (a data file cut short) is walked with plain file reads instead (storage.salvage), so
    the records it still holds, and the ones it lost, are listed all the same."""
    try:
        reader = FeatureReader(paths, check_contents=False)
        shards = reader.shards
    except StoreDamagedError as exc:
        return _verify_salvaged(paths, exc, progress_every, deep)
    report = VerifyReport()
    # the line every other command stops on, then the records that disagree (listed below)
    report.problems.extend(shard.lie for shard in shards if shard.lie is not None)
    counted: dict[str, int] = {}
    limits = [RecordLimits.from_meta(shard.meta) for shard in shards]
    index_of = {str(shard.path): i for i, shard in enumerate(shards)}

    def on_damage(store: Path, page: BrokenPage) -> None:
        if str(store) not in report.damaged:
            report.damaged.append(str(store))
        report.problems.append(f"{store}: {page.span} cannot be read: {page.reason}")

    for shard, key, value in reader.items_encoded(on_damage=on_damage):
        counted[str(shard.path)] = counted.get(str(shard.path), 0) + 1
        index = index_of[str(shard.path)]
        _check_record(report, key, value, shard.meta, limits[index] if deep else None, progress_every)
    for shard in shards:
        found = counted.get(str(shard.path), 0)
        if shard.meta["count"] != found:
            lost = " (the rest sit on broken pages)" if str(shard.path) in report.damaged else ""
            report.problems.append(
                f"{shard.path}: metadata count {shard.meta['count']} but {found} records are readable{lost}"
            )
    reader.close()
    return report


def _verify_salvaged(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    refused: StoreDamagedError,
    progress_every: int,
    deep: bool,
) -> VerifyReport:
    """`verify` with plain file reads: what `xmodal features merge --salvage` would copy, and what not.
    `refused` (why lmdb could not open them) comes first, or is raised when a store cannot be read even
    so (no metadata record left)."""
    report = VerifyReport(problems=[str(refused)])
    for path in expand([paths] if isinstance(paths, (str, os.PathLike)) else paths)[0]:
        try:
            store = salvage(path)
        except StoreDamagedError:
            raise refused from None
        if store.broken:
            report.damaged.append(str(path))
        report.problems.extend(f"{path}: {page.span} cannot be read: {page.reason}" for page in store.broken)
        report.problems.extend(store.problems)
        limits = RecordLimits.from_meta(store.meta) if deep else None
        for key, value in store.items():
            _check_record(report, key, value, store.meta, limits, progress_every)
    return report


def _check_record(
    report: VerifyReport,
    key: bytes,
    value: bytes,
    meta: dict,
    limits: RecordLimits | None,
    progress_every: int,
) -> None:
    """Check one stored value (and with `limits`, its values) into `report`."""
    img_id = key.decode("utf-8", "replace")
    try:
        codec.check(value, key)
        dtype, _, n, d, *_ = codec.read_header(value, key)
        if d != meta["feature_dim"] or dtype.name != meta["dtype"] or n > meta["max_boxes"]:
            raise CorruptRecordError(
                f"{n} boxes of {d}-d {dtype.name} features in a store of {meta['max_boxes']} boxes of "
                f"{meta['feature_dim']}-d {meta['dtype']}"
            )
        reason = problem(codec.decode(value, key), limits) if limits is not None else None
        if reason is not None:
            report.bad.append((img_id, f"unusable values: {reason}"))
    except CorruptRecordError as exc:
        report.bad.append((img_id, str(exc)))
    report.checked += 1
    if progress_every and report.checked % progress_every == 0:
        log.info("verified %d records, %d bad", report.checked, len(report.bad))
