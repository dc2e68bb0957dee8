"""`FeatureReader`: read one or several stores as one mapping, lazily opened in each process."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import lmdb

from storage import codec
from storage.errors import StoreError, StoreFormatError
from storage.metadata import META_DB, META_KEY, RECORDS_DB, decode_meta
from storage.records import RegionFeatures

_KEYS_PER_TXN = 4096


class _Shard:
    """One LMDB environment opened read-only in the current process."""

    def __init__(self, path: Path, lock: bool, readahead: bool) -> None:
        if not (path / "data.mdb").is_file():
            raise FileNotFoundError(f"{path}: no feature store here (expected a directory holding data.mdb)")
        try:
            self.env = lmdb.open(
                str(path),
                readonly=True,
                lock=lock,
                readahead=readahead,
                max_dbs=2,
                subdir=True,
                # a cached read transaction would hold a reader slot that a forked child could free
                max_spare_txns=0 if lock else 1,
            )
        except lmdb.Error as exc:
            if "already open" in str(exc):
                raise StoreError(
                    f"{path} is open for writing in this process: close the FeatureWriter before reading"
                ) from exc
            raise
        try:
            self.records = self.env.open_db(RECORDS_DB, create=False)
            self.meta_db = self.env.open_db(META_DB, create=False)
        except lmdb.NotFoundError as exc:
            self.env.close()
            raise StoreFormatError(f"{path}: no records/meta databases: not an xmodal feature store") from exc
        self.path = path
        self.lock = lock
        self.views = 0  # open `FeatureReader.view()` blocks, whose transactions pin this environment
        try:
            self.meta = self.read_meta()
        except StoreFormatError:
            self.env.close()
            raise

    def begin(self, buffers: bool = False) -> lmdb.Transaction:
        try:
            return self.env.begin(buffers=buffers)
        except lmdb.MapResizedError:
            # a writer in another process grew the file beyond our map: adopt its size
            self.env.set_mapsize(0)
            return self.env.begin(buffers=buffers)

    def read_meta(self) -> dict:
        with self.begin() as txn:
            return decode_meta(txn.get(META_KEY, db=self.meta_db), self.path)


# LMDB allows one environment per store per process: readers of the same store share it, in the
# strongest mode any of them asked for (a locked environment serves lock-free readers too, not the
# reverse). After fork the parent's environments are closed unused in the child (munmap and close(fd)
# there leave the parent's untouched; lmdb would otherwise refuse to open the same files again).
_OPEN: dict[Path, _Shard] = {}
_OPEN_PID: int | None = None
_generation = 0  # bumped on fork and when an environment is closed: readers holding one look again


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def _shard(path: Path, lock: bool, readahead: bool) -> _Shard:
    global _OPEN_PID
    if os.getpid() != _OPEN_PID:
        for inherited in _OPEN.values():
            inherited.env.close()
        _OPEN.clear()
        _OPEN_PID = os.getpid()
    key = path.resolve()
    shard = _OPEN.get(key)
    if shard is not None and lock and not shard.lock:
        # a reader beside a live writer needs the lock table: reopen with it for every reader here
        release(path)
        shard = None
    if shard is None:
        shard = _OPEN[key] = _Shard(path, lock, readahead)
    return shard


def release(path: str | os.PathLike) -> None:
    """Close this process's read-only environment of `path`, if open (a writer is about to open it, a
    locked reader replaces it, or a reader is closed). Refused while a `FeatureReader.view()` block reads
    it: its arrays point into the environment's map."""
    global _generation
    path = Path(path)
    key = path.resolve()
    shard = _OPEN.get(key) if os.getpid() == _OPEN_PID else None
    if shard is not None and shard.views:
        raise StoreError(
            f"{path} is being read in this process (an open FeatureReader.view() block): leave the "
            "block before opening it with lock=True, writing to it or closing its reader"
        )
    if shard is not None:
        del _OPEN[key]
        shard.env.close()
        _generation += 1


class FeatureReader:
    """Mapping img_id -> RegionFeatures over one store or several shards. Shards are expected to hold
    disjoint ids (`xmodal features merge` checks); where they do not, the first shard listed wins.

    Nothing is opened until first use, and handles opened in a parent process are never used after
    fork, so the reader can be handed to DataLoader workers (fork or spawn). Every read runs in its own
    short transaction. `lock=False` (default) writes no lock file and suits finished stores; pass
    `lock=True` to read a store that a writer is still filling. Readers of one store in one process
    share its environment: once any of them asked for `lock=True`, all of them read with the lock
    (an environment opened lock-free earlier is reopened); `readahead` is that of the reader that
    opened the environment: the first one, or the one whose `lock=True` reopened it.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        lock: bool = False,
        readahead: bool = False,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise ValueError("FeatureReader needs at least one store path")
        self.lock = lock
        self.readahead = readahead
        self._generation = -1
        self._shards: list[_Shard] = []

    def __getstate__(self) -> dict:
        return {"paths": self.paths, "lock": self.lock, "readahead": self.readahead}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["paths"], lock=state["lock"], readahead=state["readahead"])

    @property
    def shards(self) -> list[_Shard]:
        if self._generation != _generation:
            # after fork the parent's environments must not be used: open our own
            self._shards = self._open()
            self._generation = _generation
        return self._shards

    def _open(self) -> list[_Shard]:
        shards = [_shard(p, self.lock, self.readahead) for p in self.paths]
        first = shards[0].meta
        for shard in shards[1:]:
            for key in ("feature_dim", "dtype"):
                if shard.meta[key] != first[key]:
                    raise StoreFormatError(
                        f"{shard.path} has {key}={shard.meta[key]!r} but {shards[0].path} has "
                        f"{first[key]!r}: shards read together must agree"
                    )
        return shards

    @property
    def meta(self) -> dict:
        """The first shard's metadata, with the total count and the largest max_boxes of all shards."""
        shards = self.shards
        meta = shards[0].read_meta()
        meta["count"] = len(self)
        meta["max_boxes"] = max(s.meta["max_boxes"] for s in shards)
        if len(shards) > 1:
            meta["shards"] = [str(s.path) for s in shards]
        return meta

    @property
    def feature_dim(self) -> int:
        return self.shards[0].meta["feature_dim"]

    @property
    def max_boxes(self) -> int:
        return max(s.meta["max_boxes"] for s in self.shards)

    @property
    def dtype(self) -> str:
        return self.shards[0].meta["dtype"]

    def __len__(self) -> int:
        total = 0
        for shard in self.shards:
            with shard.begin() as txn:
                total += txn.stat(shard.records)["entries"]
        return total

    def __contains__(self, img_id: object) -> bool:
        if not isinstance(img_id, str):
            return False
        key = img_id.encode("utf-8")
        for shard in self.shards:
            with shard.begin(buffers=True) as txn:
                if txn.get(key, db=shard.records) is not None:
                    return True
        return False

    def __getitem__(self, img_id: str) -> RegionFeatures:
        try:
            key = img_id.encode("utf-8")
        except AttributeError:
            raise TypeError(f"records are keyed by image id strings, not {type(img_id).__name__}") from None
        for shard in self._shards if self._generation == _generation else self.shards:
            with shard.begin(buffers=True) as txn:
                value = txn.get(key, db=shard.records)
                if value is not None:
                    # one copy out of the map into memory we own; the arrays are views into it
                    return codec.decode(bytearray(value), key)
        raise KeyError(img_id)

    def get(self, img_id: str, default: RegionFeatures | None = None) -> RegionFeatures | None:
        try:
            return self[img_id]
        except KeyError:
            return default

    def get_encoded(self, img_id: str) -> bytes | None:
        """The stored value (record format bytes) or None."""
        key = img_id.encode("utf-8")
        for shard in self.shards:
            with shard.begin() as txn:
                value = txn.get(key, db=shard.records)
            if value is not None:
                return value
        return None

    @contextmanager
    def view(self) -> Iterator[_View]:
        """Copy-free reads: `with r.view() as v: rec = v[img_id]`; arrays are read-only views into the
        memory map, valid only inside the block (copy what you keep). One read transaction per shard is
        held open for the duration of the block."""
        shards = self.shards
        txns = [shard.begin(buffers=True) for shard in shards]
        for shard in shards:
            shard.views += 1
        try:
            yield _View(shards, txns)
        finally:
            for shard, txn in zip(shards, txns, strict=True):
                shard.views -= 1
                txn.abort()

    def keys(self) -> Iterator[str]:
        """Ids in key order, shard after shard; reads in short transactions, never holding one open."""
        for _shard, key, _ in self._scan(values=False):
            yield key.decode("utf-8")

    __iter__ = keys

    def items_encoded(self) -> Iterator[tuple[_Shard, bytes, bytes]]:
        """(shard, key, stored value) for every record, in short transactions."""
        yield from self._scan(values=True)

    def _scan(self, values: bool) -> Iterator[tuple[_Shard, bytes, bytes | None]]:
        for index in range(len(self.paths)):
            last: bytes | None = None
            while True:
                # looked up per batch: the environment may have been reopened while we yielded
                shard = self.shards[index]
                batch = []
                with shard.begin() as txn, txn.cursor(db=shard.records) as cur:
                    found = cur.set_range(last) if last is not None else cur.first()
                    if found and last is not None and cur.key() == last:
                        found = cur.next()
                    while found and len(batch) < _KEYS_PER_TXN:
                        batch.append((cur.key(), cur.value() if values else None))
                        found = cur.next()
                for key, value in batch:
                    yield shard, key, value
                if not batch or len(batch) < _KEYS_PER_TXN:
                    break
                last = batch[-1][0]

    def close(self) -> None:
        """Close this reader's environments in this process, for every reader sharing them; they
        reopen on next use. Not needed before exit."""
        for path in self.paths:
            release(path)
        self._shards = []
        self._generation = -1


class _View:
    """Records decoded straight from the memory map, valid while the enclosing `view()` block runs."""

    def __init__(self, shards: list[_Shard], txns: list[lmdb.Transaction]) -> None:
        self._pairs = list(zip(shards, txns, strict=True))

    def __getitem__(self, img_id: str) -> RegionFeatures:
        key = img_id.encode("utf-8")
        for shard, txn in self._pairs:
            value = txn.get(key, db=shard.records)
            if value is not None:
                return codec.decode(value, key)
        raise KeyError(img_id)
