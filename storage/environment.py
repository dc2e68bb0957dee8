"""Opening a store's LMDB environment safely: lmdb failures become one-line StoreErrors, and a data file
shorter than its own map is refused before any page of it is touched (reading past its end is SIGBUS)."""

from __future__ import annotations

import importlib
import struct
from pathlib import Path

from storage.btree import BrokenPage, TreeWalk, walk_records
from storage.errors import StoreError
from storage.metadata import RECORDS_DB

DATA_FILE = "data.mdb"


class StoreDamagedError(StoreError, ValueError):
    """A store's files are truncated, emptied or hold broken pages: names the store and what to do."""


class StoreOpenError(StoreError, OSError):
    """The system refused to open a store (permissions, disk space, a path that is not a directory)."""


class _Lmdb:
    """The lmdb module, imported on first use: `import storage` works on a machine without lmdb, and
    opening a store there is a one-line StoreOpenError."""

    def __getattr__(self, name: str) -> object:
        try:
            module = importlib.import_module("lmdb")
        except ImportError as exc:
            raise StoreOpenError(
                f"opening a feature store needs the lmdb package, which cannot be imported ({exc}): "
                "install it with `pip install lmdb`"
            ) from exc
        value = getattr(module, name)
        setattr(self, name, value)  # later lookups skip this method
        return value


lmdb = _Lmdb()


def _damage() -> tuple[type[Exception], ...]:
    """What lmdb raises on files that are not (or no longer) sound LMDB files."""
    return (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError, lmdb.PageNotFoundError)


def damaged(path: Path, exc: BaseException, what: str = "", whole: bool = False) -> StoreDamagedError:
    """The error for an lmdb failure while reading `path`; `what` says which read failed, `whole` that
    nothing of the store can be read (its databases, metadata or tree)."""
    at = f" {what}" if what else ""
    todo = (
        "nothing in it can be read: restore it from a copy, or re-extract or re-import it"
        if whole
        else f"run `xmodal features verify {path}` to see what is lost, then re-extract or re-import it"
    )
    return StoreDamagedError(
        f"store {path} is damaged ({type(exc).__name__}{at}: {_reason(exc, path)}); {todo}"
    )


def lmdb_failure(path: Path, exc: lmdb.Error, what: str, whole: bool = False) -> StoreError:
    """The error for an lmdb failure on `path`: damage (see `damaged`) when lmdb found broken pages,
    otherwise what the system refused (reader slots, disk space, permissions) as a StoreOpenError."""
    if isinstance(exc, _damage()):
        return damaged(path, exc, what, whole)
    return StoreOpenError(
        f"store {path}: {what} failed ({type(exc).__name__}: {_reason(exc, path)}); check free disk "
        "space, permissions and the number of processes reading it"
    )


def walk_store(path: Path, txnid: int, values: bool = False) -> TreeWalk:
    """The walk of `path`'s records tree as of transaction `txnid` (storage.btree); a walk that cannot
    even start (no meta page, a short read) is a StoreDamagedError."""
    try:
        return walk_records(path / DATA_FILE, RECORDS_DB, txnid, values)
    except (OSError, ValueError, struct.error) as exc:
        raise damaged(path, exc, "walking its pages", whole=True) from exc


def broken_tree(path: Path, broken: list[BrokenPage], key: bytes | None = None) -> StoreDamagedError:
    """The error for a store whose walk (storage.btree) found broken pages; `key`: the id looked up."""
    first = broken[0]
    more = f" (and {len(broken) - 1} more broken pages)" if len(broken) > 1 else ""
    asked = f"{key.decode('utf-8', 'replace')!r} may be lost: " if key is not None else ""
    return StoreDamagedError(
        f"store {path} is damaged: {asked}{first.span} cannot be read ({first.reason}){more}; run "
        f"`xmodal features verify {path}` to see what is lost, then re-extract or re-import it"
    )


def open_environment(path: Path, **options) -> lmdb.Environment:
    """`lmdb.open(path, **options)`, refusing an empty, truncated or broken data file with a
    StoreDamagedError, what the system refuses with a StoreOpenError, and a store open for writing in
    this process with a StoreError."""
    data = path / DATA_FILE
    try:
        size = data.stat().st_size
    except FileNotFoundError:
        size = None  # a writer creates it
    if size == 0:
        raise StoreDamagedError(
            f"store {path}: {data} is empty (0 bytes), not a feature store; delete the directory and "
            "re-extract or re-import it"
        )
    try:
        env = lmdb.open(str(path), subdir=True, **options)
    except lmdb.Error as exc:
        if "already open" in str(exc):
            raise StoreError(
                f"{path} is open for writing in this process: close the FeatureWriter before reading"
            ) from exc
        if isinstance(exc, _damage()):
            raise StoreDamagedError(
                f"store {path} cannot be opened ({_reason(exc, path)}): its {DATA_FILE} is damaged or not "
                "an LMDB file; delete the directory and re-extract or re-import it"
            ) from exc
        raise StoreOpenError(
            f"store {path} cannot be opened ({_reason(exc, path)}); check the path, its permissions and "
            "free disk space"
        ) from exc
    if size is not None:
        try:
            _check_length(env, data)
        except StoreDamagedError:
            env.close()
            raise
    return env


def _check_length(env: lmdb.Environment, data: Path) -> None:
    """The last committed page must lie inside the file: the header pages are read with read(), but every
    other page through the memory map, where a page past the end of the file kills the process."""
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    # measured after the meta was read: a live writer writes pages before the meta naming them
    size = data.stat().st_size
    if size < needed:
        raise StoreDamagedError(
            f"store {data.parent} is truncated: {data} holds {size} bytes but its last committed page ends "
            f"at byte {needed} (a copy or a disk that ran out of space?); restore it from a complete copy, "
            f"or copy the records it still holds with `xmodal features merge --salvage {data.parent} NEW`"
        )


def _reason(exc: BaseException, path: Path) -> str:
    """lmdb's message without the leading path, which the caller names already."""
    text = str(exc)
    return text.removeprefix(f"{path}: ")
