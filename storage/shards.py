"""Shard sets: one directory holding several stores written side by side (one per extraction replica) and a
manifest, read as one store wherever a store path is taken."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from storage.errors import StoreError, StoreFormatError
from storage.file_checks import MANIFEST_LIMIT, read_json_file

MANIFEST = "shards.json"
SET_FORMAT = "xmodal-region-shards"
SET_FORMAT_VERSION = 1
SHARD_PREFIX = "shard-"
WRITER_LOCK = "writer.lock"  # held by a shard's writer across each of its commits
# provenance entries that may differ between shards made by one job (library versions of each node)
INCIDENTAL = ("merged_from", "versions")


def is_shard_set(path: str | os.PathLike) -> bool:
    """Whether `path` holds a manifest (of any kind: one that is not a regular file is refused on reading)."""
    return os.path.lexists(Path(path) / MANIFEST)


def shard_path(root: str | os.PathLike, index: int) -> Path:
    """The store that replica `index` writes under the set `root`."""
    return Path(root) / f"{SHARD_PREFIX}{index:03d}"


def shards_of(root: str | os.PathLike) -> list[Path]:
    """The stores of the set `root` that hold data, in name order (a replica killed before its first commit
    leaves none)."""
    root = Path(root)
    return sorted(p for p in root.glob(f"{SHARD_PREFIX}*") if (p / "data.mdb").is_file())


def expand(paths: Sequence[str | os.PathLike]) -> tuple[list[Path], list[Path | None]]:
    """Every store path, a shard set replaced by its shards; beside each, the set it came from (or None).

    A set without any shard yet is a FileNotFoundError naming it."""
    stores: list[Path] = []
    sets: list[Path | None] = []
    for given in paths:
        path = Path(given)
        if not is_shard_set(path):
            stores.append(path)
            sets.append(None)
            continue
        read_manifest(path)
        found = shards_of(path)
        if not found:
            raise FileNotFoundError(f"shard set {path} holds no shard yet (no {SHARD_PREFIX}*/data.mdb)")
        stores.extend(found)
        sets.extend([path] * len(found))
    return stores, sets


def read_manifest(root: str | os.PathLike) -> dict:
    path = Path(root) / MANIFEST
    manifest = read_json_file(path, MANIFEST_LIMIT, "restore it or re-extract the set")
    if not isinstance(manifest, dict) or manifest.get("format") != SET_FORMAT:
        raise StoreFormatError(f"{path} does not describe an {SET_FORMAT} set")
    if manifest.get("format_version", 0) > SET_FORMAT_VERSION:
        raise StoreFormatError(
            f"{path}: shard set format version {manifest['format_version']} is newer than this xmodal reads "
            f"({SET_FORMAT_VERSION}); upgrade xmodal"
        )
    return manifest


class StaleWriterError(StoreError):
    """A shard's writer belongs to a job that a later one has replaced."""


def write_manifest(root: str | os.PathLike, provenance: dict, writer: str) -> None:
    """Create or replace the manifest of the set `root`: the one provenance record of all its shards, and
    the token of the job allowed to write them."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": SET_FORMAT,
        "format_version": SET_FORMAT_VERSION,
        "provenance": provenance,
        "writer": writer,
    }
    tmp = root / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, root / MANIFEST)


def claim(root: str | os.PathLike, writer: str) -> None:
    """Make the job `writer` the only one that may write the set `root`, and return once no earlier job
    can commit to it any more: after the manifest names the new writer, every shard's lock is taken once,
    so an earlier job's commit either came before (and is seen by whoever reads the set next) or finds
    itself replaced (see `writing`). A killed job's replicas may outlive their driver for a while."""
    root = Path(root)
    provenance = read_manifest(root).get("provenance", {}) if is_shard_set(root) else {}
    write_manifest(root, provenance, writer)
    for shard in sorted(root.glob(f"{SHARD_PREFIX}*")):
        if (shard / WRITER_LOCK).is_file():
            with open(shard / WRITER_LOCK, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released by close


@contextmanager
def writing(shard: str | os.PathLike, writer: str) -> Iterator[None]:
    """Hold `shard`'s writer lock for a write, which the job `writer` may make only while the set's
    manifest names it; StaleWriterError when a later job has claimed the set."""
    shard = Path(shard)
    shard.mkdir(parents=True, exist_ok=True)
    with open(shard / WRITER_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if read_manifest(shard.parent).get("writer") != writer:
            raise StaleWriterError(
                f"{shard}: a later extraction job has taken over {shard.parent}; this replica writes no more"
            )
        yield


def making(meta: dict) -> dict:
    """What made a store's records (detector, settings, weights): its provenance less incidental entries."""
    return {k: v for k, v in meta.get("provenance", {}).items() if k not in INCIDENTAL}


def check_set_members(root: Path, members: list[tuple[Path, dict]]) -> None:
    """The shards of one set were made the same way; else StoreFormatError naming the odd shard."""
    first_path, first = members[0]
    for path, meta in members[1:]:
        made, want = making(meta), making(first)
        differ = sorted(k for k in {*made, *want} if made.get(k) != want.get(k))
        if differ:
            raise StoreFormatError(
                f"shard {path} of {root} was made differently from {first_path} ({', '.join(differ)} "
                "differ): one set holds one extraction's shards; move it out or re-extract it"
            )
