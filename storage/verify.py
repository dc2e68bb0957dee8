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
from storage.errors import CorruptRecordError
from storage.reader import FeatureReader
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
    broken page, reports it. `deep` also checks each record's values (storage.validate)."""
    reader = FeatureReader(paths, check_contents=False)
    report = VerifyReport()
    # the line every other command stops on, then the records that disagree (listed below)
    report.problems.extend(shard.lie for shard in reader.shards if shard.lie is not None)
    counted: dict[str, int] = {}
    limits = [RecordLimits.from_meta(shard.meta) for shard in reader.shards]
    index_of = {str(shard.path): i for i, shard in enumerate(reader.shards)}

    def on_damage(store: Path, page: BrokenPage) -> None:
        if str(store) not in report.damaged:
            report.damaged.append(str(store))
        report.problems.append(f"{store}: {page.span} cannot be read: {page.reason}")

    for shard, key, value in reader.items_encoded(on_damage=on_damage):
        counted[str(shard.path)] = counted.get(str(shard.path), 0) + 1
        img_id = key.decode("utf-8", "replace")
        try:
            codec.check(value, key)
            dtype, _, n, d, *_ = codec.read_header(value, key)
            meta = shard.meta
            if d != meta["feature_dim"] or dtype.name != meta["dtype"] or n > meta["max_boxes"]:
                raise CorruptRecordError(
                    f"{n} boxes of {d}-d {dtype.name} features in a store of {meta['max_boxes']} boxes of "
                    f"{meta['feature_dim']}-d {meta['dtype']}"
                )
            reason = problem(codec.decode(value, key), limits[index_of[str(shard.path)]]) if deep else None
            if reason is not None:
                report.bad.append((img_id, f"unusable values: {reason}"))
        except CorruptRecordError as exc:
            report.bad.append((img_id, str(exc)))
        report.checked += 1
        if progress_every and report.checked % progress_every == 0:
            log.info("verified %d records, %d bad", report.checked, len(report.bad))
    for shard in reader.shards:
        found = counted.get(str(shard.path), 0)
        if shard.meta["count"] != found:
            lost = " (the rest sit on broken pages)" if str(shard.path) in report.damaged else ""
            report.problems.append(
                f"{shard.path}: metadata count {shard.meta['count']} but {found} records are readable{lost}"
            )
    reader.close()
    return report
