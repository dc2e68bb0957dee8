"""Combine several stores (extraction shards) into one."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from storage import codec
from storage.btree import BrokenPage
from storage.environment import DATA_FILE
from storage.errors import CorruptRecordError, StoreError
from storage.reader import FeatureReader
from storage.shards import expand
from storage.writer import FeatureWriter

log = logging.getLogger(__name__)


class DuplicateIdError(StoreError, ValueError):
    """Two sources hold the same image id."""


@dataclass
class Merged:
    """How many records a merge wrote, and what a salvaging merge left out (one line each)."""

    written: int
    left_out: list[str] = field(default_factory=list)


def merge_stores(
    srcs: Sequence[str | os.PathLike],
    dst: str | os.PathLike,
    first_wins: bool = False,
    dtype: str | None = None,
    salvage: bool = False,
) -> Merged:
    """Copy every record of `srcs` into `dst`; say how many were written and what was left out.

    Ids held by several sources are an error naming them (checked before anything is written) unless
    `first_wins`. `dst` may be a previous, interrupted merge: the records it already holds are kept. A
    damaged source stops the merge unless `salvage`: then what it still holds is copied, and its broken
    pages and the records failing their checksum are logged and left out (re-extract those: extraction
    skips stored ids). A shard set (storage.shards) among `srcs` stands for its shards. `dst` must
    not be a source: that is refused before anything is opened for writing."""
    _refuse_source_as_destination(srcs, dst)
    for src in srcs:
        FeatureReader(src).shards  # noqa: B018  (a set's shards made differently are refused, by name)
    srcs = expand(srcs)[0]
    broken: dict[tuple[str, int], str] = {}
    corrupt: list[str] = []

    def on_damage(store: Path, page: BrokenPage) -> None:
        if (str(store), page.pgno) not in broken:
            broken[str(store), page.pgno] = f"{store}: {page.span} left out ({page.reason})"
            log.warning("%s", broken[str(store), page.pgno])

    damage = on_damage if salvage else None
    readers = [FeatureReader(p) for p in srcs]
    dims = {r.feature_dim for r in readers}
    if len(dims) > 1:
        raise StoreError(
            f"sources hold features of different widths {sorted(dims)}: {[str(p) for p in srcs]}"
        )
    owner: dict[str, str] = {}
    duplicates: dict[str, list[str]] = {}
    for reader in readers:
        for img_id in reader.keys(on_damage=damage):
            if img_id in owner:
                duplicates.setdefault(img_id, [owner[img_id]]).append(str(reader.paths[0]))
            else:
                owner[img_id] = str(reader.paths[0])
    if duplicates and not first_wins:
        shown = "; ".join(f"{i!r} in {', '.join(p)}" for i, p in list(duplicates.items())[:10])
        more = f" and {len(duplicates) - 10} more" if len(duplicates) > 10 else ""
        raise DuplicateIdError(
            f"{len(duplicates)} ids are held by several sources: {shown}{more}; "
            "pass --first-wins to keep the copy from the first source listed"
        )
    out_dtype = dtype or readers[0].dtype
    written = 0
    provenance = {
        **_shared_provenance(srcs, readers),
        "merged_from": [
            {"path": str(Path(p).resolve()), "count": len(r)} for p, r in zip(srcs, readers, strict=True)
        ],
    }
    with FeatureWriter(
        dst,
        feature_dim=dims.pop(),
        max_boxes=max(r.max_boxes for r in readers),
        dtype=out_dtype,
        meta=provenance,
    ) as writer:
        for reader in readers:
            source = str(reader.paths[0])
            for _shard, key, value in reader.items_encoded(on_damage=damage):
                img_id = key.decode("utf-8")
                if owner[img_id] != source:
                    continue
                try:
                    codec.check(value, key)
                except CorruptRecordError as exc:
                    if not salvage:
                        raise
                    corrupt.append(f"{source}: left out: {exc}")
                    log.warning("%s", corrupt[-1])
                    continue
                if reader.dtype == out_dtype:
                    written += writer.put_encoded(img_id, value)
                else:
                    written += writer.put(reader[img_id])
            log.info("%s: merged, %d records written so far", source, written)
            reader.close()
    return Merged(written, [*broken.values(), *corrupt])


def _refuse_source_as_destination(srcs: Sequence[str | os.PathLike], dst: str | os.PathLike) -> None:
    """Refuse a `dst` that is one of `srcs`, one of their shards, or their data file under another name
    (a link, a bind mount): same device and inode, so links and `..` cannot hide it."""
    dst = Path(dst)
    if not dst.exists():
        return
    data = dst / DATA_FILE
    for src in dict.fromkeys([*map(Path, srcs), *expand(srcs)[0]]):
        same = _same_file(src, dst) or (data.exists() and _same_file(src / DATA_FILE, data))
        if same:
            how = "" if dst.resolve() == src.resolve() else f" (it resolves to {dst.resolve()})"
            raise StoreError(
                f"cannot merge into {dst}: it is the source {src}{how}, and a source is never written; "
                "give a new destination path"
            )


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# provenance entries that may differ between sources made the same way
_INCIDENTAL = ("merged_from", "versions")


def _shared_provenance(srcs: Sequence[str | os.PathLike], readers: list[FeatureReader]) -> dict:
    """The sources' provenance (what made them: detector, settings, weights) when they all agree, so the
    merged store still says how to reproduce its features (`xmodal ask` rebuilds the detector from it);
    nothing, with a warning naming the settings that differ, when they do not."""
    made = [{k: v for k, v in r.meta.get("provenance", {}).items() if k not in _INCIDENTAL} for r in readers]
    differ = sorted({k for m in made for k in m if any(m.get(k) != o.get(k) for o in made)})
    if not differ:
        return made[0]
    log.warning(
        "the sources were made differently (%s differ between %s): the merged store records no detector "
        "settings; commands that rebuild the detector (ask, serve) then use the preset's defaults",
        ", ".join(differ),
        ", ".join(str(p) for p in srcs),
    )
    return {}
