"""`FeatureWriter`: append region records to an LMDB store in batched, crash-safe commits."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from storage import codec, metadata
from storage.environment import StoreOpenError, broken_tree, lmdb, lmdb_failure, open_environment, walk_store
from storage.errors import StoreError
from storage.metadata import META_DB, META_KEY, RECORDS_DB, decode_meta, encode_meta, new_meta
from storage.reader import release
from storage.records import RegionFeatures

log = logging.getLogger(__name__)
DEFAULT_FEATURE_DIM = 2048  # LXMERT's RoI features, when nothing says otherwise


def _make_directory(path: Path) -> None:
    """`path` as a directory, made if missing: a file, FIFO or link to one there, or a file above it, is
    a one-line StoreOpenError naming it (never written through, never replaced)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        what = (
            "it is a link to nothing"
            if path.is_symlink() and not path.exists()
            else "it, or a folder above it, is not a directory (a file, FIFO or link to one)"
        )
        raise StoreOpenError(
            f"{path} cannot hold a feature store: {what}; give a new path or a store directory"
        ) from None
    except OSError as exc:
        raise StoreOpenError(f"{path} cannot be made a store directory ({exc.strerror})") from None


class FeatureWriter:
    """Writes one store (a directory); opening an existing store appends to it (resume).

    Records are committed every `commit_every` records or `commit_bytes` bytes, so a crash loses at most
    the uncommitted batch. The map grows by itself when full.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        feature_dim: int = DEFAULT_FEATURE_DIM,
        max_boxes: int = 36,
        dtype: str = "float16",
        meta: dict | None = None,
        replace: bool = False,
        commit_every: int = 256,
        commit_bytes: int = 64 << 20,
        map_size: int = 1 << 30,
    ) -> None:
        self.path = Path(path)
        self.replace = replace
        self.commit_every = max(1, int(commit_every))
        self.commit_bytes = max(1, int(commit_bytes))
        _make_directory(self.path)
        release(self.path)  # LMDB allows one environment per store per process
        self._env = open_environment(self.path, map_size=int(map_size), max_dbs=2, readahead=False)
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        # both databases and the metadata appear in one commit: a reader never sees half a store
        self._txn: lmdb.Transaction | None = None
        try:
            self._txn = self._env.begin(write=True)
            # appending to a tree with broken pages would make lmdb abort or spread the damage; the
            # write lock held, the last commit (the one before ours) cannot change during the walk
            broken = walk_store(self.path, self._txn.id() - 1).broken
            if broken:
                raise broken_tree(self.path, broken)
            self._records = self._env.open_db(RECORDS_DB, txn=self._txn)
            self._meta_db = self._env.open_db(META_DB, txn=self._txn)
            raw = self._txn.get(META_KEY, db=self._meta_db)
        except (lmdb.Error, StoreError) as exc:
            if self._txn is not None:
                self._txn.abort()
            self._env.close()
            if isinstance(exc, StoreError):
                raise
            raise lmdb_failure(self.path, exc, "opening it for writing", whole=True) from exc
        try:
            if raw is None:
                self.meta = new_meta(feature_dim, max_boxes, dtype, meta)
            else:
                self.meta = decode_meta(raw, self.path)
                self._check_compatible(feature_dim, max_boxes, dtype)
                self.meta["provenance"].update(meta or {})
        except ValueError:
            self._txn.abort()
            self._env.close()
            raise
        self._meta_dirty = raw is None or bool(meta)
        self._commit()

    def _check_compatible(self, feature_dim: int, max_boxes: int, dtype: str) -> None:
        asked = {"feature_dim": int(feature_dim), "max_boxes": int(max_boxes), "dtype": dtype}
        for key, value in asked.items():
            if self.meta[key] != value:
                raise ValueError(
                    f"{self.path}: existing store has {key}={self.meta[key]!r} but the writer asked for "
                    f"{value!r}; write to a new path or open with {key}={self.meta[key]!r}"
                )

    @property
    def feature_dim(self) -> int:
        return self.meta["feature_dim"]

    @property
    def max_boxes(self) -> int:
        return self.meta["max_boxes"]

    @property
    def dtype(self) -> str:
        return self.meta["dtype"]

    def __len__(self) -> int:
        try:
            return self._write_txn().stat(self._records)["entries"]
        except lmdb.Error as exc:
            raise lmdb_failure(self.path, exc, "counting records") from exc

    def __contains__(self, img_id: str) -> bool:
        try:
            return self._write_txn().get(img_id.encode("utf-8"), db=self._records) is not None
        except lmdb.Error as exc:
            raise lmdb_failure(self.path, exc, f"looking up {img_id!r}") from exc

    def put(self, rec: RegionFeatures) -> bool:
        """Add one record; False (nothing written) if the id exists and the writer is not in replace mode."""
        rec.validate(feature_dim=self.feature_dim, max_boxes=self.max_boxes)
        if not self.replace and rec.img_id in self:
            return False
        if rec.class_probs is not None:  # a version 1 store that gets a layout 2 record becomes version 2
            self.meta["format_version"] = max(
                self.meta["format_version"], metadata.CLASS_PROBS_FORMAT_VERSION
            )
        return self.put_encoded(rec.img_id, codec.encode(rec, self.dtype))

    def put_encoded(self, img_id: str, value: bytes | bytearray) -> bool:
        """Add a value already in the record format (as copied from another store of the same dtype)."""
        key = img_id.encode("utf-8")
        dtype, _, n, d, *_ = codec.read_header(value, key)
        if d != self.feature_dim or n > self.max_boxes or dtype.name != self.dtype:
            raise ValueError(
                f"record {img_id!r}: {n} boxes of {d}-d {dtype.name} features do not fit {self.path} "
                f"({self.max_boxes} boxes of {self.feature_dim}-d {self.dtype})"
            )
        if not self._put_with_growth(key, value):
            return False
        self._pending.append((key, value))
        self._pending_bytes += len(value)
        if len(self._pending) >= self.commit_every or self._pending_bytes >= self.commit_bytes:
            self._commit()
        return True

    def update_meta(self, provenance: dict) -> None:
        """Merge keys into the free-form provenance; saved with the next commit."""
        self.meta["provenance"].update(provenance)
        self._meta_dirty = True

    def flush(self) -> None:
        """Commit everything written so far."""
        if self._pending or self._meta_dirty:
            self._commit()

    def close(self) -> None:
        if self._env is None:
            return
        self.flush()
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
        self._env.close()
        self._env = None

    def __enter__(self) -> FeatureWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def _write_txn(self) -> lmdb.Transaction:
        if self._env is None:
            raise ValueError(f"{self.path}: the writer is closed")
        if self._txn is None:
            self._txn = self._env.begin(write=True)
        return self._txn

    def _put_with_growth(self, key: bytes, value: bytes) -> bool:
        while True:
            try:
                return self._write_txn().put(key, value, db=self._records, overwrite=self.replace)
            except lmdb.MapFullError:
                self._grow(len(value))
            except lmdb.Error as exc:
                raise lmdb_failure(self.path, exc, f"writing {key.decode('utf-8', 'replace')!r}") from exc

    def _commit(self) -> None:
        while True:
            txn = self._write_txn()
            try:
                self.meta["count"] = txn.stat(self._records)["entries"]
                txn.put(META_KEY, encode_meta(self.meta), db=self._meta_db)
                txn.commit()
            except lmdb.MapFullError:
                self._grow(0)
                continue
            except lmdb.Error as exc:
                raise lmdb_failure(self.path, exc, "committing") from exc
            self._txn = None
            break
        self._pending.clear()
        self._pending_bytes = 0
        self._meta_dirty = False

    def _grow(self, extra: int) -> None:
        """MapFullError aborted the open transaction: enlarge the map, then replay the uncommitted batch."""
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
        old = self._env.info()["map_size"]
        new = max(2 * old, old + 2 * (self._pending_bytes + extra))
        log.debug("%s: map full at %d bytes, growing to %d", self.path, old, new)
        self._env.set_mapsize(new)
        txn = self._write_txn()
        for key, value in self._pending:
            try:
                txn.put(key, value, db=self._records, overwrite=self.replace)
            except lmdb.MapFullError:
                self._grow(extra)
                return
