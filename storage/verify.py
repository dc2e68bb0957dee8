"""Whole-store integrity check: every record decodes, matches its checksum and fits the store's shapes."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from storage import codec
from storage.errors import CorruptRecordError
from storage.reader import FeatureReader

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    checked: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)  # (img_id, reason)
    problems: list[str] = field(default_factory=list)  # store-level problems (count mismatch)

    @property
    def ok(self) -> bool:
        return not self.bad and not self.problems


def verify(
    paths: str | os.PathLike | Sequence[str | os.PathLike], progress_every: int = 10000
) -> VerifyReport:
    """Check every record of one store or several shards; never raises on a bad record, reports it."""
    reader = FeatureReader(paths)
    report = VerifyReport()
    counted: dict[str, int] = {}
    for shard, key, value in reader.items_encoded():
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
        except CorruptRecordError as exc:
            report.bad.append((img_id, str(exc)))
        report.checked += 1
        if progress_every and report.checked % progress_every == 0:
            log.info("verified %d records, %d bad", report.checked, len(report.bad))
    for shard in reader.shards:
        found = counted.get(str(shard.path), 0)
        if shard.meta["count"] != found:
            report.problems.append(
                f"{shard.path}: metadata count {shard.meta['count']} but {found} records are stored"
            )
    reader.close()
    return report
