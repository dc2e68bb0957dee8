"""Combine several stores (extraction shards) into one."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from storage import codec
from storage.environment import DATA_FILE
from storage.errors import CorruptRecordError, StoreError
from storage.reader import FeatureReader
from storage.salvage import salvage
from storage.shards import check_set_members, expand
from storage.writer import FeatureWriter

log = logging.getLogger(__name__)


class DuplicateIdError(StoreError, ValueError):
    """Two sources hold the same image id."""


@dataclass
class Merged:
    """How many records a merge wrote, and what a salvaging merge left out (one line each)."""

    written: int
    left_out: list[str] = field(default_factory=list)


@dataclass
class _Source:
    """One store to copy from: its metadata, its ids and its (key, stored value) pairs, in key order."""

    path: Path
    meta: dict
    ids: Callable[[], Iterable[bytes]]
    items: Callable[[], Iterable[tuple[bytes, bytes]]]
    count: int


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
    damaged source stops the merge unless `salvage`: then every intact record it still holds is copied
    (read with plain file reads, storage.salvage: a file cut short or a metadata record that lies does
    not stop it), and its broken pages and the records failing their checks are logged and left out
    (re-extract those: extraction skips stored ids). A shard set (storage.shards) among `srcs` stands for
    its shards. `dst` must not be a source: that is refused before anything is opened for writing."""
    _refuse_source_as_destination(srcs, dst)
    left_out: list[str] = []
    sources = _salvaged(srcs, left_out) if salvage else _readers(srcs)
    dims = {s.meta["feature_dim"] for s in sources}
    if len(dims) > 1:
        raise StoreError(
            f"sources hold features of different widths {sorted(dims)}: {[str(s.path) for s in sources]}"
        )
    owner: dict[bytes, Path] = {}
    duplicates: dict[bytes, list[str]] = {}
    for source in sources:
        for key in source.ids():
            if key in owner:
                duplicates.setdefault(key, [str(owner[key])]).append(str(source.path))
            else:
                owner[key] = source.path
    if duplicates and not first_wins:
        shown = "; ".join(
            f"{k.decode('utf-8', 'replace')!r} in {', '.join(p)}" for k, p in list(duplicates.items())[:10]
        )
        more = f" and {len(duplicates) - 10} more" if len(duplicates) > 10 else ""
        raise DuplicateIdError(
            f"{len(duplicates)} ids are held by several sources: {shown}{more}; "
            "pass --first-wins to keep the copy from the first source listed"
        )
    out_dtype = dtype or sources[0].meta["dtype"]
    written = 0
    provenance = {
        **_shared_provenance([s.path for s in sources], [s.meta for s in sources]),
        "merged_from": [{"path": str(s.path.resolve()), "count": s.count} for s in sources],
    }
    with FeatureWriter(
        dst,
        feature_dim=dims.pop(),
        max_boxes=max(s.meta["max_boxes"] for s in sources),
        dtype=out_dtype,
        meta=provenance,
    ) as writer:
        for source in sources:
            for key, value in source.items():
                if owner[key] != source.path:
                    continue
                try:
                    codec.check(value, key)
                    if source.meta["dtype"] == out_dtype:
                        written += writer.put_encoded(key.decode("utf-8"), value)
                    else:
                        written += writer.put(codec.decode(value, key))
                except (CorruptRecordError, ValueError) as exc:
                    # ValueError: a record that does not fit the store's shapes (its metadata lied)
                    if not salvage:
                        raise
                    left_out.append(f"{source.path}: left out: {exc}")
                    log.warning("%s", left_out[-1])
            log.info("%s: merged, %d records written so far", source.path, written)
    return Merged(written, left_out)


def _readers(srcs: Sequence[str | os.PathLike]) -> list[_Source]:
    """The sources read through lmdb: any damage, or metadata that lies, is refused by name."""
    for src in srcs:
        FeatureReader(src).shards  # noqa: B018  (a set's shards made differently are refused, by name)
    sources = []
    for path in expand(srcs)[0]:
        reader = FeatureReader(path)
        sources.append(
            _Source(
                path,
                reader.meta,
                lambda r=reader: (k.encode("utf-8") for k in r),
                lambda r=reader: ((k, v) for _, k, v in r.items_encoded()),
                len(reader),
            )
        )
    return sources


def _salvaged(srcs: Sequence[str | os.PathLike], left_out: list[str]) -> list[_Source]:
    """The sources read with plain file reads: each broken page goes to `left_out`, and what the metadata
    misstates is logged (the records themselves are what is copied)."""
    paths, sets = expand(srcs)
    found = [salvage(path) for path in paths]
    for root in dict.fromkeys(s for s in sets if s is not None):
        check_set_members(root, [(f.path, f.meta) for f, s in zip(found, sets, strict=True) if s == root])
    sources = []
    for store in found:
        for problem in store.problems:
            log.warning("%s", problem)
        for page in store.broken:
            left_out.append(f"{store.path}: {page.span} left out ({page.reason})")
            log.warning("%s", left_out[-1])
        sources.append(
            _Source(store.path, store.meta, lambda s=store: s.walk.keys, store.items, len(store.walk.keys))
        )
    return sources


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


def _shared_provenance(srcs: Sequence[Path], metas: list[dict]) -> dict:
    """The sources' provenance (what made them: detector, settings, weights) when they all agree, so the
    merged store still says how to reproduce its features (`xmodal ask` rebuilds the detector from it);
    nothing, with a warning naming the settings that differ, when they do not."""
    made = [{k: v for k, v in m.get("provenance", {}).items() if k not in _INCIDENTAL} for m in metas]
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
