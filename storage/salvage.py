"""Reading what a damaged store still holds with plain file reads (storage.btree), never through lmdb or
its memory map: a data file cut short, a metadata record that lies or broken pages cannot stop it."""

from __future__ import annotations

import json
import os
import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from storage.btree import BrokenPage, TreeWalk, read_value, transactions, walk_records
from storage.environment import DATA_FILE, StoreDamagedError
from storage.errors import StoreError
from storage.metadata import META_DB, META_KEY, RECORDS_DB, decode_meta


@dataclass
class Salvage:
    """The intact records of one store, the pages that hide the others, and its metadata record."""

    path: Path
    meta: dict
    walk: TreeWalk
    problems: list[str] = field(default_factory=list)  # store-level: a short file, a count that lies

    @property
    def broken(self) -> list[BrokenPage]:
        return self.walk.broken

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """(key, stored value) of every intact record, in key order; values are checked by the caller
        (storage.codec.check): a page reused since the walk shows up as a corrupt record, not as data."""
        with open(self.path / DATA_FILE, "rb") as f:
            for key, where in zip(self.walk.keys, self.walk.where, strict=True):
                yield key, read_value(f, where)


def salvage(path: str | os.PathLike) -> Salvage:
    """Walk `path`'s last committed snapshot, and where its pages are broken, the one before (lmdb keeps
    two): the records those pages hid may still lie intact in the older tree. The metadata record is the
    newest one readable. A StoreDamagedError when no metadata record can be read at all."""
    path = Path(path)
    data = path / DATA_FILE
    try:
        snapshots = transactions(data)
        walk = walk_records(data, RECORDS_DB, snapshots[0], values=True, locate=True)
        if walk.broken and len(snapshots) > 1:
            _add_hidden(walk, walk_records(data, RECORDS_DB, snapshots[1], values=True, locate=True))
        meta, stale = _meta(path, data, snapshots)
    except (OSError, ValueError, struct.error, StoreError) as exc:  # struct: a file shorter than a page
        raise StoreDamagedError(
            f"store {path} cannot be salvaged: {exc}; restore it from a copy, or re-extract or re-import it"
        ) from exc
    found = Salvage(path, meta, walk)
    if stale is not None:
        found.problems.append(
            f"{path}: its last metadata record cannot be read ({stale}); the one before is used"
        )
    if meta["count"] != len(walk.keys) and not walk.broken:  # broken pages say what is missing
        found.problems.append(
            f"{path}: metadata count {meta['count']} but {len(walk.keys)} records are readable"
        )
    return found


def _add_hidden(walk: TreeWalk, older: TreeWalk) -> None:
    """Add to `walk` the keys of `older` that `walk`'s broken pages hide, keeping key order."""
    known = set(walk.keys)

    def rows(w: TreeWalk) -> zip:
        return zip(w.keys, w.where, w.value_at, w.value_size, w.leaf_at, strict=True)

    found = [row for row in rows(older) if row[0] not in known and any(p.holds(row[0]) for p in walk.broken)]
    if found:
        merged = sorted([*rows(walk), *found])
        walk.keys = [row[0] for row in merged]
        walk.where = [row[1] for row in merged]
        for i, name in enumerate(("value_at", "value_size", "leaf_at"), start=2):
            setattr(walk, name, array("q", [row[i] for row in merged]))


def _meta(path: Path, data: Path, snapshots: list[int]) -> tuple[dict, str | None]:
    """The newest readable metadata record, and why the last one could not be read (None: it was)."""
    why = None
    for txnid in snapshots:
        walk = walk_records(data, META_DB, txnid, locate=True)
        if META_KEY not in walk.keys:
            why = walk.broken[0].reason if walk.broken else "no metadata record"
            continue
        with open(data, "rb") as f:
            raw = read_value(f, walk.where[walk.keys.index(META_KEY)])
        try:
            return decode_meta(raw, path), why
        except (ValueError, json.JSONDecodeError) as exc:
            why = f"{exc}"
    raise StoreDamagedError(f"its metadata record cannot be read ({why})")
