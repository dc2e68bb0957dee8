"""The records a training run will read, checked once before it starts (storage.validate): an inf feature,
a zero image size, a NaN box or an out-of-range label stops the run naming the record and its store, or
with `--skip-bad-records` is logged and the examples using it are dropped."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import numpy as np

from pipelines.data.columns import RowColumns
from storage import FeatureReader
from storage.checks import check_records

log = logging.getLogger(__name__)

E = TypeVar("E")


def bad_records(features: FeatureReader, ids: Iterable[str], skip: bool) -> dict[str, str]:
    """id -> reason for each record of `ids` that fails the checks; without `skip` the first one raises
    storage.BadRecordError (one line: the record, the store, the fix). Ids must be in the store. Checked
    in file order and remembered for the store's snapshot (storage.checks): a second run on an unchanged
    store reads none of them again."""
    return check_records(features, ids, skip)


def drop_bad(
    examples: Sequence[E],
    images: Callable[[E], Iterable[str]],
    features: FeatureReader,
    skip: bool,
    what: str,
    resolve: Callable[[str], str] | None = None,
) -> Sequence[E]:
    """`examples` without those reading a bad record (see `bad_records`); says how many were dropped.
    `RowColumns` are checked image by image of their image table, each name through `resolve` (the
    store's id of an image reference)."""
    if isinstance(examples, RowColumns):
        stored = {name: (resolve or str)(name) for name in examples.used_images()}
        bad = bad_records(features, dict.fromkeys(stored.values()), skip)
        if not bad:
            return examples
        usable = np.array([stored.get(n) not in bad for n in examples.image_names], dtype=bool)
        kept = examples.select_images(usable)
    else:
        ids = dict.fromkeys(img for ex in examples for img in images(ex))
        bad = bad_records(features, ids, skip)
        if not bad:
            return list(examples)
        kept = [ex for ex in examples if not any(img in bad for img in images(ex))]
    log_dropped(what, len(examples) - len(kept), len(examples), len(bad))
    return kept


def log_dropped(what: str, dropped: int, total: int, bad: int) -> None:
    log.warning(
        "%s: skipped %d of %d examples reading %d bad records (--skip-bad-records)", what, dropped, total, bad
    )
