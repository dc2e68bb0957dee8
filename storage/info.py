"""Summary of a store for `xmodal features info`: shapes, count, size on disk, provenance."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from storage.environment import broken_tree
from storage.reader import FeatureReader

log = logging.getLogger(__name__)


def describe(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> dict:
    """Metadata of one store or several shards read as one (count = records actually stored), plus the
    bytes its files take on disk."""
    reader = FeatureReader(paths)
    meta = reader.meta
    for shard in reader.shards:
        if shard.broken:  # the metadata still reads, but the records do not all
            log.warning("%s", broken_tree(shard.path, shard.broken))
    reader.close()
    meta["paths"] = [str(p) for p in reader.paths]
    meta["size_on_disk"] = sum(f.stat().st_blocks * 512 for p in reader.paths for f in Path(p).glob("*.mdb"))
    return meta


def format_size(n: int) -> str:
    """Bytes in binary units: '1.5 GiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
