"""`FeatureReader`: read one or several stores as one mapping, lazily opened in each process."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

try:
    import resource
except ImportError:  # not on Windows: reads are then always requested
    resource = None

from storage import codec
from storage.batch import Allocator, RegionBatch, fill_batch
from storage.btree import BrokenPage, TreeWalk
from storage.contents import contents_lie
from storage.environment import (
    StoreDamagedError,
    broken_tree,
    lmdb,
    lmdb_failure,
    open_environment,
    walk_store,
)
from storage.errors import StoreError, StoreFormatError
from storage.metadata import META_DB, META_KEY, RECORDS_DB, decode_meta
from storage.records import RegionFeatures
from storage.shards import check_set_members, expand
from storage.validate import BadRecordError, RecordLimits, bad_record, problem

log = logging.getLogger(__name__)

_KEYS_PER_TXN = 4096


_WATCH_EVERY = 16
_MAX_HINTED = 1 << 16


def major_faults() -> int:
    """Page faults this thread has waited on the disk for (0 where the system does not count them)."""
    if resource is None:
        return 0
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_majflt


_DEFAULT_PIECE = 128 << 10  # Linux's default read-ahead window


def willneed_piece(fd: int) -> int:
    """The most bytes one WILLNEED call reads on the device holding file `fd`: Linux reads at most the
    larger of its read-ahead window and its largest request (`read_ahead_kb`, `max_sectors_kb`) and drops
    the rest of the range. 128 KB, the default window, where the system does not say."""
    try:
        dev = os.fstat(fd).st_dev
        name = f"{os.major(dev)}:{os.minor(dev)}"
    except (OSError, AttributeError):
        return _DEFAULT_PIECE
    found = []
    for folder in (
        f"/sys/class/bdi/{name}",
        f"/sys/dev/block/{name}/queue",
        f"/sys/dev/block/{name}/../queue",
    ):
        for setting in ("read_ahead_kb", "max_sectors_kb"):
            try:
                with open(f"{folder}/{setting}", encoding="ascii") as fh:
                    found.append(int(fh.read().strip()) << 10)
            except (OSError, ValueError):
                continue
    return max(found) if found and max(found) >= 4096 else _DEFAULT_PIECE


def request_ranges(fd: int, ranges: Sequence[tuple[int, int]], piece: int = _DEFAULT_PIECE) -> None:
    """posix_fadvise(WILLNEED) each (offset, size) range of file `fd`, in calls of at most `piece` bytes
    (`willneed_piece`): the kernel starts reading all of them into the page cache without waiting for any,
    so the disk gets them queued together. A hint only: where the system has no such call, reads fault the
    pages in as before."""
    if not hasattr(os, "posix_fadvise"):
        return
    for start, size in ranges:
        for at in range(start, start + size, piece):
            os.posix_fadvise(fd, at, min(piece, start + size - at), os.POSIX_FADV_WILLNEED)


def wrong_record(path: Path, asked: str, found: str) -> StoreDamagedError:
    """The error for a value stored under `asked` that holds the record of `found` (a broken pointer)."""
    return StoreDamagedError(
        f"store {path} is damaged: the value stored under {asked!r} is the record of {found!r}; run "
        f"`xmodal features verify {path}` to see what is lost, then re-extract or re-import it"
    )


class _Shard:
    """One LMDB environment opened read-only in the current process."""

    def __init__(self, path: Path, lock: bool, readahead: bool) -> None:
        if not (path / "data.mdb").is_file():
            raise FileNotFoundError(f"{path}: no feature store here (expected a directory holding data.mdb)")
        self.env = open_environment(
            path,
            readonly=True,
            lock=lock,
            readahead=readahead,
            max_dbs=2,
            # a cached read transaction would hold a reader slot that a forked child could free
            max_spare_txns=0 if lock else 1,
        )
        self.path = path
        try:
            self.records = self.env.open_db(RECORDS_DB, create=False)
            self.meta_db = self.env.open_db(META_DB, create=False)
        except lmdb.NotFoundError as exc:
            self.env.close()
            raise StoreFormatError(f"{path}: no records/meta databases: not an xmodal feature store") from exc
        except lmdb.Error as exc:
            self.env.close()
            raise lmdb_failure(path, exc, "opening its databases", whole=True) from exc
        self.lock = lock
        self._fd: int | None = None  # data.mdb, for read hints (`request`)
        self._piece = 0  # the most one read hint asks for (`willneed_piece`)
        # whether reads are requested ahead: until a read finds all its pages in memory, and again from
        # the first read that waits for the disk (a warm store then pays no call per value)
        self.ahead = True
        # keys asked for ahead of their read (`request(..., ahead=True)`), not read since: their read asks
        # nothing more, and does not take their pages, found in memory, for a warm store
        self.hinted: set[bytes] = set()
        self.probe = hasattr(os, "preadv") and hasattr(os, "RWF_NOWAIT")
        self._scratch = bytearray()
        self._unwatched = 0  # warm single reads since one was watched (`get`)
        self.views = 0  # open `FeatureReader.view()` blocks, whose transactions pin this environment
        self._walk: TreeWalk | None = None
        self._walk_values = False
        try:
            self.lie = self._open_checks()
        except StoreError:
            self.env.close()
            raise

    def _open_checks(self) -> str | None:
        """Read the metadata and walk the records tree in one read transaction (a live writer changes
        neither meanwhile); the one-line error when the metadata lies about the records (storage.contents),
        else None. A store with broken pages is not sampled: its reads report the damage."""
        with self.begin(buffers=True) as txn:
            self.meta = self._meta_in(txn)
            # a few reads per thousand records: tells a damaged page from a missing id on every lookup
            self._walk = walk_store(self.path, txn.id())
            self.broken = self._walk.broken
            if self.broken:
                return None

            def value_of(key: bytes) -> memoryview | None:
                try:
                    return txn.get(key, db=self.records)
                except lmdb.Error:
                    return None  # a broken value page: reading that record reports it, `verify` lists it

            return contents_lie(self.path, self.meta, self._walk.keys, value_of)

    def close(self) -> None:
        self.env.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def request(self, keys: Iterable[bytes], ahead: bool = False) -> int:
        """Ask the disk for the value pages of every one of `keys` at once, before any is read: lmdb's
        reads (py-lmdb touches each page of a value as it looks it up) would otherwise fault a cold value
        in one page, one disk read, at a time. Where the values lie comes from the walk of the tree made
        at open (storage.btree), so nothing of the map is touched here; adjacent values merge into one
        range, and nothing beside them is read. A value the walk did not see (written since, or on a
        broken page) is not requested: its read checks and reports it as before.

        A warm store pays no call per value: when every value asked for is already in memory, requests
        stop until a read waits for the disk again (`settle`). Returns the thread's major fault count,
        for `settle`.

        `ahead`: the keys are not read now but soon (the next batch, while this one is being used): their
        pages are asked for, and their read then asks nothing more. Whether the store is warm is judged
        here, before asking, never from pages this reader itself asked for."""
        walk = self._walk
        if ahead:
            if not (self.ahead and walk):
                return major_faults()
            keys = [key for key in keys if key not in self.hinted]
            if len(self.hinted) > _MAX_HINTED:  # hints nobody read: the order was not the one guessed
                self.hinted.clear()
            self.hinted.update(keys)
        elif self.hinted:
            keys = list(keys)
            asked = self.hinted.intersection(keys)
            self.hinted -= asked
            keys = [key for key in keys if key not in asked]
        spans = sorted(span for key in keys for span in walk.spans(key)) if self.ahead and walk else ()
        if not spans:
            return major_faults()
        if self._fd is None:
            self._fd = os.open(self.path / "data.mdb", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self._piece = willneed_piece(self._fd)
        if self._in_memory(spans):
            self.ahead = False
            return major_faults()
        merged: list[list[int]] = []
        for start, size in spans:
            if merged and start <= merged[-1][0] + merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], start + size - merged[-1][0])
            else:
                merged.append([start, size])
        request_ranges(self._fd, [(start, size) for start, size in merged], self._piece)
        return major_faults()

    def _in_memory(self, spans: list[tuple[int, int]]) -> bool:
        """Whether every span is in the page cache: read without waiting for the disk (RWF_NOWAIT stops
        at the first byte that is not), so a cold store answers at its first value."""
        if not self.probe:
            return False
        for start, size in spans:
            if len(self._scratch) < size:
                self._scratch = bytearray(size)
            try:
                if os.preadv(self._fd, [memoryview(self._scratch)[:size]], start, os.RWF_NOWAIT) < size:
                    return False
            except BlockingIOError:
                return False
            except OSError:  # a file system that cannot tell: request every read
                self.probe = False
                return False
        return True

    def settle(self, faults: int) -> None:
        """After reading what `request` was given (which returned `faults`): a read that waited for the
        disk turns requests back on."""
        if major_faults() > faults:
            self.ahead = True

    def tree(self, values: bool = False) -> TreeWalk:
        """The walk of the records tree (storage.btree), made once; `values` also checks value pages."""
        if self._walk is None or (values and not self._walk_values):
            # the read transaction pins the snapshot walked: a writer cannot reuse its pages meanwhile
            with self.begin() as txn:
                self._walk = walk_store(self.path, txn.id(), values)
            self._walk_values = values
            self.broken = self._walk.broken
        return self._walk

    def hidden(self, key: bytes) -> None:
        """Raise StoreDamagedError if a broken page may hold `key` (which lmdb did not find)."""
        for page in self.broken:
            if page.holds(key):
                raise broken_tree(self.path, [page], key)

    def begin(self, buffers: bool = False) -> lmdb.Transaction:
        try:
            try:
                return self.env.begin(buffers=buffers)
            except lmdb.MapResizedError:
                # a writer in another process grew the file beyond our map: adopt its size
                self.env.set_mapsize(0)
                return self.env.begin(buffers=buffers)
        except lmdb.Error as exc:
            raise lmdb_failure(self.path, exc, "starting a read", whole=True) from exc

    def has(self, key: bytes) -> bool:
        """Whether `key` is stored. The walk made at open answers for the keys it saw without lmdb, whose
        lookup (py-lmdb touches every page of the value found) would read the whole value from disk."""
        if self._walk is not None and self._walk.value_span(key) != (-1, -1):
            return True
        return self._lookup(key, lambda value: True) is not None

    def get(self, key: bytes, buffers: bool = False) -> bytes | bytearray | None:
        """The stored value of `key`, read in its own transaction, or None: bytes, or with `buffers` a
        bytearray (which decodes into writable arrays). Its pages are requested together first."""
        copy = bytearray if buffers else bytes
        if not self.ahead:
            # warm: one read in _WATCH_EVERY watches for disk waits, the rest pay nothing for it
            self._unwatched = (self._unwatched + 1) % _WATCH_EVERY
            if self._unwatched:
                return self._lookup(key, copy)
        faults = self.request([key])
        value = self._lookup(key, copy)
        self.settle(faults)
        return value

    def _lookup(self, key: bytes, take: Callable[[memoryview], object]) -> object | None:
        """`take(value)` of `key`'s value, inside its read transaction, or None when it is absent."""
        if self.broken:
            self.hidden(key)  # never let lmdb search a broken page: on some it aborts the process
        with self.begin(buffers=True) as txn:
            try:
                value = txn.get(key, db=self.records)
            except lmdb.Error as exc:
                raise lmdb_failure(self.path, exc, f"reading {key.decode('utf-8', 'replace')!r}") from exc
            return None if value is None else take(value)

    def count(self) -> int:
        with self.begin() as txn:
            try:
                return txn.stat(self.records)["entries"]
            except lmdb.Error as exc:
                raise lmdb_failure(self.path, exc, "counting records") from exc

    def read_meta(self) -> dict:
        with self.begin() as txn:
            return self._meta_in(txn)

    def _meta_in(self, txn: lmdb.Transaction) -> dict:
        try:
            raw = txn.get(META_KEY, db=self.meta_db)
        except lmdb.Error as exc:
            raise lmdb_failure(self.path, exc, "reading its metadata", whole=True) from exc
        return decode_meta(raw, self.path)


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
            inherited.close()
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
        shard.close()
        _generation += 1


class FeatureReader:
    """Mapping img_id -> RegionFeatures over one store or several shards. Shards are expected to hold
    disjoint ids (`xmodal features merge` checks); where they do not, the first shard listed wins. A shard
    set directory (storage.shards: what `xmodal extract --shards per-replica` writes) stands for its
    shards, which must have been made the same way; `paths` lists the stores actually read.

    Nothing is opened until first use, and handles opened in a parent process are never used after
    fork, so the reader can be handed to DataLoader workers (fork or spawn). Every read runs in its own
    short transaction. `lock=False` (default) writes no lock file and suits finished stores; pass
    `lock=True` to read a store that a writer is still filling. Readers of one store in one process
    share its environment: once any of them asked for `lock=True`, all of them read with the lock
    (an environment opened lock-free earlier is reopened); `readahead` is that of the reader that
    opened the environment: the first one, or the one whose `lock=True` reopened it.

    A truncated, emptied or damaged store raises StoreDamagedError (never a crash signal, never a
    missing id), as does one whose metadata record disagrees with its records (storage.contents; pass
    `check_contents=False` to read it anyway, as `verify` does to list what disagrees).
    `validate=True` checks each record read (storage.validate) and raises BadRecordError
    naming it; `skip_bad=True` also logs each bad record once, keeps it in `skipped` (this process's
    reads) and makes `get` return the default for it.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        lock: bool = False,
        readahead: bool = False,
        validate: bool = False,
        skip_bad: bool = False,
        check_contents: bool = True,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        if not paths:
            raise ValueError("FeatureReader needs at least one store path")
        self.paths, self._sets = expand(paths)
        self.lock = lock
        self.readahead = readahead
        self.validate = validate or skip_bad
        self.skip_bad = skip_bad
        self.check_contents = check_contents
        self.skipped: dict[str, str] = {}  # img_id -> reason, for the bad records this process skipped
        self._limits: list[RecordLimits] = []
        self._generation = -1
        self._shards: list[_Shard] = []

    def __getstate__(self) -> dict:
        return {
            "paths": self.paths,
            "lock": self.lock,
            "readahead": self.readahead,
            "validate": self.validate,
            "skip_bad": self.skip_bad,
            "check_contents": self.check_contents,
            "sets": self._sets,
        }

    def __setstate__(self, state: dict) -> None:
        sets = state.pop("sets", None)
        self.__init__(**state)
        if sets is not None:  # the shards the sender read, even if a job added one since
            self.paths, self._sets = state["paths"], sets

    @property
    def shards(self) -> list[_Shard]:
        if self._generation != _generation:
            # after fork the parent's environments must not be used: open our own
            self._shards = self._open()
            self._generation = _generation
        return self._shards

    def _open(self) -> list[_Shard]:
        shards = [_shard(p, self.lock, self.readahead) for p in self.paths]
        for shard in shards:
            if shard.lie is not None and self.check_contents:
                raise StoreDamagedError(shard.lie)
        first = shards[0].meta
        for shard in shards[1:]:
            for key in ("feature_dim", "dtype"):
                if shard.meta[key] != first[key]:
                    raise StoreFormatError(
                        f"{shard.path} has {key}={shard.meta[key]!r} but {shards[0].path} has "
                        f"{first[key]!r}: shards read together must agree"
                    )
        for root in dict.fromkeys(s for s in self._sets if s is not None):
            members = [(sh.path, sh.meta) for sh, s in zip(shards, self._sets, strict=True) if s == root]
            check_set_members(root, members)
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
        return sum(shard.count() for shard in self.shards)

    def __contains__(self, img_id: object) -> bool:
        if not isinstance(img_id, str):
            return False
        key = img_id.encode("utf-8")
        if any(shard.has(key) for shard in self.shards):
            return True
        for shard in self.shards:
            shard.hidden(key)
        return False

    def __getitem__(self, img_id: str) -> RegionFeatures:
        try:
            key = img_id.encode("utf-8")
        except AttributeError:
            raise TypeError(f"records are keyed by image id strings, not {type(img_id).__name__}") from None
        shards = self._shards if self._generation == _generation else self.shards
        for index, shard in enumerate(shards):
            # one copy out of the map into memory we own; the arrays are views into it
            value = shard.get(key, buffers=True)
            if value is not None:
                rec = codec.decode(value, key)
                if rec.img_id != img_id:
                    raise wrong_record(shard.path, img_id, rec.img_id)
                if self.validate:
                    self._check(rec, index)
                return rec
        for shard in shards:
            shard.hidden(key)
        raise KeyError(img_id)

    def get(self, img_id: str, default: RegionFeatures | None = None) -> RegionFeatures | None:
        """The record, or `default` when the id is missing or (with `skip_bad`) the record is bad."""
        try:
            return self[img_id]
        except KeyError:
            return default
        except BadRecordError:
            if not self.skip_bad:
                raise
            return default

    def check(self, rec: RegionFeatures, shard_index: int = 0) -> str | None:
        """Why `rec` (read from shard `shard_index`) must not be trained on, or None: see storage.validate."""
        if len(self._limits) != len(self.paths):
            self._limits = [RecordLimits.from_meta(shard.meta) for shard in self.shards]
        return problem(rec, self._limits[shard_index])

    def _check(self, rec: RegionFeatures, shard_index: int) -> None:
        reason = self.check(rec, shard_index)
        if reason is None:
            return
        if self.skip_bad and rec.img_id not in self.skipped:
            self.skipped[rec.img_id] = reason
            log.warning("skipping record %r of store %s: %s", rec.img_id, self.paths[shard_index], reason)
        raise bad_record(rec, self.paths[shard_index], reason)

    def get_encoded(self, img_id: str) -> bytes | None:
        """The stored value (record format bytes) or None."""
        key = img_id.encode("utf-8")
        for shard in self.shards:
            value = shard.get(key)
            if value is not None:
                return value
        for shard in self.shards:
            shard.hidden(key)
        return None

    @contextmanager
    def view(self) -> Iterator[_View]:
        """Copy-free reads: `with r.view() as v: rec = v[img_id]`; arrays are read-only views into the
        memory map, valid only inside the block (copy what you keep). One read transaction per shard is
        held open for the duration of the block. Records are checked as `reader[img_id]` checks them."""
        shards = self.shards
        txns = [shard.begin(buffers=True) for shard in shards]
        for shard in shards:
            shard.views += 1
        try:
            yield _View(shards, txns, self._check if self.validate else None)
        finally:
            for shard, txn in zip(shards, txns, strict=True):
                shard.views -= 1
                txn.abort()

    def request_ahead(self, img_ids: Iterable[str]) -> None:
        """Ask the disk now for the records of `img_ids`, to be read soon (by `read_batch`, `[]` or `get`):
        a loader asks for its next batch before it reads and uses this one, so the disk works while the
        CPU does. Nothing is read; a warm store pays for nothing."""
        keys = [img_id.encode("utf-8") for img_id in img_ids]
        for shard in self.shards:
            shard.request(keys, ahead=True)

    def read_batch(
        self, img_ids: Sequence[str], width: int | None = None, alloc: Allocator = np.empty
    ) -> RegionBatch:
        """The records of `img_ids` (repeats allowed) copied into one padded `RegionBatch`, all read in
        one transaction per shard: one copy out of the map, straight into the batch's arrays (made by
        `alloc`), features in the store's dtype. `width`: slots per image (None = the most boxes among
        them). A missing id raises KeyError; records are checked as `reader[img_id]` checks them."""
        with self.view() as view:
            unique = {img_id: None for img_id in img_ids}
            faults = view.request(unique)
            for img_id in unique:
                unique[img_id] = view[img_id]
            view.settle(faults)
            records = [unique[img_id] for img_id in img_ids]
            dtype = np.dtype(self.dtype).newbyteorder("<")
            return fill_batch(records, width, self.feature_dim, dtype, alloc)

    def keys(self, on_damage: Callable[[Path, BrokenPage], None] | None = None) -> Iterator[str]:
        """Ids in key order, shard after shard; reads in short transactions, never holding one open.
        Broken pages: as `items_encoded`. An id held by several shards is listed once (the first shard's
        record is the one read), and a full listing warns how many there are, as `merge` refuses them."""
        if len(self.paths) == 1:
            for _shard, key, _ in self._scan(values=False, on_damage=on_damage):
                yield key.decode("utf-8")
            return
        owner: dict[bytes, Path] = {}
        repeated: dict[bytes, list[Path]] = {}
        for shard, key, _ in self._scan(values=False, on_damage=on_damage):
            first = owner.setdefault(key, shard.path)
            if first != shard.path:
                repeated.setdefault(key, [first]).append(shard.path)
                continue
            yield key.decode("utf-8")
        if repeated:
            key, where = next(iter(repeated.items()))
            log.warning(
                "%d ids are held by several shards (e.g. %r in %s): each is read from the first shard "
                "listed; `xmodal features merge` refuses such shards, so check that the same images were "
                "not extracted twice",
                len(repeated),
                key.decode("utf-8", "replace"),
                " and ".join(map(str, where)),
            )

    __iter__ = keys

    def items_encoded(
        self, on_damage: Callable[[Path, BrokenPage], None] | None = None
    ) -> Iterator[tuple[_Shard, bytes, bytes]]:
        """(shard, key, stored value) for every record, in short transactions. A store with broken pages
        raises StoreDamagedError, unless `on_damage(store, page)` is given: it is told of each broken
        page, and the records the intact pages hold are still read."""
        yield from self._scan(values=True, on_damage=on_damage)

    def _scan(
        self, values: bool, on_damage: Callable[[Path, BrokenPage], None] | None = None
    ) -> Iterator[tuple[_Shard, bytes, bytes | None]]:
        for index in range(len(self.paths)):
            broken = self.shards[index].tree(values=on_damage is not None)
            if broken.broken:
                if on_damage is None:
                    raise broken_tree(self.paths[index], broken.broken)
                for page in broken.broken:
                    on_damage(self.paths[index], page)
                # lmdb's cursor would step onto the broken pages: read the intact keys one by one
                yield from self._read_keys(index, broken.keys, values)
                continue
            last: bytes | None = None
            while True:
                # looked up per batch: the environment may have been reopened while we yielded
                shard = self.shards[index]
                batch = []
                with shard.begin() as txn, txn.cursor(db=shard.records) as cur:
                    try:
                        found = cur.set_range(last) if last is not None else cur.first()
                        if found and last is not None and cur.key() == last:
                            found = cur.next()
                        while found and len(batch) < _KEYS_PER_TXN:
                            batch.append((cur.key(), cur.value() if values else None))
                            found = cur.next()
                    except lmdb.Error as exc:
                        where = f"past {last.decode('utf-8', 'replace')!r}" if last else "from the start"
                        raise lmdb_failure(shard.path, exc, f"scanning {where}") from exc
                for key, value in batch:
                    yield shard, key, value
                if not batch or len(batch) < _KEYS_PER_TXN:
                    break
                last = batch[-1][0]

    def _read_keys(
        self, index: int, keys: list[bytes], values: bool
    ) -> Iterator[tuple[_Shard, bytes, bytes | None]]:
        for start in range(0, len(keys), _KEYS_PER_TXN):
            shard = self.shards[index]
            batch = [(key, shard.get(key) if values else None) for key in keys[start : start + _KEYS_PER_TXN]]
            for key, value in batch:
                yield shard, key, value

    def close(self) -> None:
        """Close this reader's environments in this process, for every reader sharing them; they
        reopen on next use. Not needed before exit."""
        for path in self.paths:
            release(path)
        self._shards = []
        self._generation = -1


class _View:
    """Records decoded straight from the memory map, valid while the enclosing `view()` block runs."""

    def __init__(
        self,
        shards: list[_Shard],
        txns: list[lmdb.Transaction],
        check: Callable[[RegionFeatures, int], None] | None,
    ) -> None:
        self._pairs = list(zip(shards, txns, strict=True))
        self._check = check

    def request(self, img_ids: Iterable[str]) -> list[int]:
        """Ask the disk for all the values of `img_ids` at once (see `_Shard.request`), so that reading
        them next waits for the disk about once rather than once per page; pass the result to `settle`
        once they are read."""
        keys = [img_id.encode("utf-8") for img_id in img_ids]
        return [shard.request(keys) for shard, _ in self._pairs]

    def settle(self, faults: list[int]) -> None:
        for (shard, _), before in zip(self._pairs, faults, strict=True):
            shard.settle(before)

    def _lookup(self, img_id: str) -> tuple[int, memoryview] | None:
        """(shard index, value in the map) of `img_id`, or None when no shard holds it."""
        key = img_id.encode("utf-8")
        for index, (shard, txn) in enumerate(self._pairs):
            if shard.broken:
                shard.hidden(key)
            try:
                value = txn.get(key, db=shard.records)
            except lmdb.Error as exc:
                raise lmdb_failure(shard.path, exc, f"reading {img_id!r}") from exc
            if value is not None:
                return index, value
        return None

    def read(self, img_id: str) -> tuple[RegionFeatures, int] | None:
        """(record, index of the shard it was read from) of `img_id`, unchecked, or None when no shard
        holds it."""
        found = self._lookup(img_id)
        if found is None:
            key = img_id.encode("utf-8")
            for shard, _ in self._pairs:
                shard.hidden(key)
            return None
        index, value = found
        rec = codec.decode(value, img_id.encode("utf-8"))
        if rec.img_id != img_id:
            raise wrong_record(self._pairs[index][0].path, img_id, rec.img_id)
        return rec, index

    def __getitem__(self, img_id: str) -> RegionFeatures:
        found = self.read(img_id)
        if found is None:
            raise KeyError(img_id)
        rec, index = found
        if self._check is not None:
            self._check(rec, index)
        return rec
