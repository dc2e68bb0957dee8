"""The value checks of the records a run will read (storage.validate), made once per store snapshot: read in
file order with their pages requested together, and remembered, so the next run on an unchanged store
reads no record for them."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import secrets
import time
import zlib
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from storage.reader import FeatureReader
from storage.validate import RecordLimits, bad_record_named

log = logging.getLogger(__name__)

CACHE_ENV = "XMODAL_CACHE"  # where caches go; default ~/.cache/xmodal
MEMO_VERSION = 1
BATCH = 256  # records requested together
SAVE_EVERY_S = 30.0  # a check stopped part-way keeps what it found until then


def cache_root() -> Path:
    """`$XMODAL_CACHE`, else `~/.cache/xmodal`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "xmodal")


class _Memo:
    """What the checks found in one snapshot of a set of stores: one bit per record (the records of each
    shard in key order, shard after shard) set once it was checked, and each bad record's reason. Named
    after the snapshot: the stores' files (path, device, inode, size, change time), their last committed
    transaction and the limits they were checked against; any change names another memo."""

    def __init__(self, reader: FeatureReader, folder: Path | None) -> None:
        self.walks = [shard.tree() for shard in reader.shards]
        self.starts = np.cumsum([0] + [len(w.keys) for w in self.walks]).tolist()
        self.checked = np.zeros(self.starts[-1], dtype=bool)
        self.bad: dict[str, tuple[int, str]] = {}  # id -> (shard index, reason)
        self.path = None if folder is None else folder / f"{self._name(reader)}.json"
        self.saved = time.monotonic()
        if self.path is not None:
            self._load()

    @staticmethod
    def _name(reader: FeatureReader) -> str:
        snapshot = []
        for shard in reader.shards:
            data = (shard.path / "data.mdb").resolve()
            st = os.stat(data)
            snapshot.append(
                {
                    "data": str(data),
                    "file": [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns],
                    "txn": shard.env.info()["last_txnid"],
                    "limits": asdict(RecordLimits.from_meta(shard.meta)),
                }
            )
        text = json.dumps({"version": MEMO_VERSION, "stores": snapshot}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def _load(self) -> None:
        try:
            memo = json.loads(self.path.read_text(encoding="utf-8"))
            bits = np.unpackbits(np.frombuffer(zlib.decompress(base64.b64decode(memo["checked"])), np.uint8))
            if memo["records"] != len(self.checked) or len(bits) < len(self.checked):
                raise ValueError("for another number of records")
            self.checked = bits[: len(self.checked)].astype(bool)
            self.bad = {str(k): (int(i), str(r)) for k, (i, r) in memo["bad"].items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, zlib.error) as exc:
            log.warning("record checks memo %s is unreadable (%s): checking again", self.path, exc)
            self.checked[:] = False
            self.bad = {}

    def position(self, key: bytes) -> tuple[int, int] | None:
        """(shard index, bit) of the record `key` reads, or None where the walk did not see it."""
        for index, walk in enumerate(self.walks):
            i = bisect_left(walk.keys, key)
            if i < len(walk.keys) and walk.keys[i] == key:
                return index, self.starts[index] + i
        return None

    def save(self, force: bool = False) -> None:
        """Write the memo (a temporary file renamed over it); at most every SAVE_EVERY_S unless `force`. A
        memo that cannot be written is only a check made again next time."""
        if self.path is None or not (force or time.monotonic() - self.saved >= SAVE_EVERY_S):
            return
        self.saved = time.monotonic()
        memo = {
            "records": len(self.checked),
            "checked": base64.b64encode(zlib.compress(np.packbits(self.checked).tobytes())).decode(),
            "bad": {k: list(v) for k, v in self.bad.items()},
        }
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(memo), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning(
                "could not keep the record checks in %s (%s): the next run checks again", self.path, exc
            )


def check_records(
    features: FeatureReader, ids: Iterable[str], skip: bool, cache: str | os.PathLike | None = "default"
) -> dict[str, str]:
    """id -> reason for each record of `ids` that fails storage.validate's checks; without `skip` the first
    one raises BadRecordError (one line: the record, the store, the fix), with `skip` each is logged once.
    Ids must be in the store (one that is not is left out).

    The records are read in the order they lie in the file, `BATCH` at a time with their pages requested
    together (a cold store is read at about the disk's rate), and what was found is kept in `cache`
    (default `$XMODAL_CACHE/record-checks`; None keeps nothing) under the stores' snapshot: a later check
    on unchanged stores reads only the records not checked before."""
    checker = FeatureReader(features.paths)
    folder = cache_root() / "record-checks" if cache == "default" else None if cache is None else Path(cache)
    memo = _Memo(checker, folder)
    found: dict[str, str] = {}
    todo: list[tuple[int, int, str, int | None]] = []  # (shard, file offset, id, bit)
    for img_id in dict.fromkeys(ids):
        at = memo.position(img_id.encode("utf-8"))
        if at is not None and memo.checked[at[1]]:
            if img_id in memo.bad:
                index, reason = memo.bad[img_id]
                _found(checker.paths[index], img_id, reason, skip, found)
            continue
        if at is None:
            todo.append((len(memo.walks), 0, img_id, None))
        else:
            walk = memo.walks[at[0]]
            todo.append((at[0], walk.value_at[at[1] - memo.starts[at[0]]], img_id, at[1]))
    todo.sort()
    try:
        for start in range(0, len(todo), BATCH):
            chunk = todo[start : start + BATCH]
            with checker.view() as view:
                faults = view.request(img_id for _, _, img_id, _ in chunk)
                for _, _, img_id, bit in chunk:
                    got = view.read(img_id)
                    if got is None:
                        continue
                    rec, index = got
                    reason = checker.check(rec, index)
                    if bit is not None:
                        memo.checked[bit] = True
                        if reason is not None:
                            memo.bad[img_id] = (index, reason)
                    if reason is not None:
                        _found(checker.paths[index], img_id, reason, skip, found)
                view.settle(faults)
            memo.save()
    finally:
        memo.save(force=True)
    return found


def _found(store: Path, img_id: str, reason: str, skip: bool, found: dict[str, str]) -> None:
    if not skip:
        raise bad_record_named(img_id, store, reason)
    if img_id not in found:
        found[img_id] = reason
        log.warning("skipping record %r of store %s: %s", img_id, store, reason)
