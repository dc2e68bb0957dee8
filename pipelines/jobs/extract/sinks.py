"""Where the records of an extraction job go: one store the driver writes, or a shard set the replicas
write themselves (the driver then only counts ids and never holds region bytes)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


class StoreSink:
    """One store: replicas return records and the driver writes them."""

    def __init__(self, writer) -> None:
        self.writer = writer

    def take(self, records: list) -> int:
        """Write a replica's records; how many were new."""
        return sum(1 for rec in records if self.writer.put(rec))

    def flush(self) -> None:
        self.writer.flush()

    def committed(self, slot: int, ids: Iterable[str]) -> set[str]:
        """Nothing of a dead replica's batches reached the store: only the driver writes it."""
        return set()


class ShardSink:
    """A shard set: each replica writes its shard and returns the ids it committed."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def take(self, ids: list[str]) -> int:
        return len(ids)

    def flush(self) -> None:
        """Nothing to do: each replica commits at the end of each call."""

    def committed(self, slot: int, ids: Iterable[str]) -> set[str]:
        """Which of `ids` the dead replica of `slot` committed to its shard before it died.

        Asked once every call of that replica has come back (so it writes no more), and before any of
        the ids is handed out again: an id it committed is done, never extracted into a second shard."""
        from storage import FeatureReader
        from storage.shards import shard_path

        path = shard_path(self.root, slot)
        if not (path / "data.mdb").is_file():
            return set()
        reader = FeatureReader(path, lock=True)
        try:
            return {img_id for img_id in ids if img_id in reader}
        finally:
            reader.close()
