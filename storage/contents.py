"""The one check every reader of a store runs on opening it: does the metadata record tell the truth
about what the store holds (its count, and the dtype, feature size and box count of records sampled
across it)? Shapes taken from a lying metadata record would size batches, models and shared memory."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from storage import codec
from storage.errors import CorruptRecordError

SAMPLES = 16  # records whose headers are read on open: first, last and evenly between (a few µs each)


def sample_keys(keys: Sequence[bytes], samples: int = SAMPLES) -> list[bytes]:
    """Up to `samples` of `keys`, first and last included, evenly spaced."""
    if len(keys) <= samples:
        return list(keys)
    step = (len(keys) - 1) / (samples - 1)
    return [keys[round(i * step)] for i in range(samples)]


Claims = Callable[[bytes, bytes, dict], list[tuple[str, bool, str]]]
REGION_REMEDY = (
    "run `xmodal features verify {path}`, then re-extract or re-import it, or copy its records with "
    "`xmodal features merge --salvage {path} NEW`"
)


def region_claims(value: bytes, key: bytes, meta: dict) -> list[tuple[str, bool, str]]:
    """(metadata key, whether the region record agrees, what the record holds) for one stored record."""
    dtype, _, n, d, *_ = codec.read_header(value, key)
    return [
        ("dtype", dtype.name == meta["dtype"], f"{dtype.name} features"),
        ("feature_dim", d == meta["feature_dim"], f"{d}-d features"),
        ("max_boxes", n <= meta["max_boxes"], f"{n} boxes"),
    ]


def contents_lie(
    path: Path,
    meta: dict,
    keys: Sequence[bytes],
    value_of: Callable[[bytes], object | None],
    claims: Claims = region_claims,
    remedy: str = REGION_REMEDY,
) -> str | None:
    """The one-line error for a store whose metadata disagrees with what it holds, or None. `keys`: every
    key of the records tree (as walked in the same read transaction as `meta`); `value_of(key)`: the
    stored value; `claims`: what a record says about the metadata's keys (region records by default; the
    image-token store passes its own); `remedy`: what to do, `{path}` filled in. A sampled record whose
    own header is corrupt is left to the reads (and `verify`)."""

    def lie(claim: str, truth: str) -> str:
        return (
            f"store {path} is damaged: its metadata record says {claim} but {truth}; "
            f"{remedy.format(path=path)}"
        )

    if meta["count"] != len(keys):
        return lie(f"count={meta['count']}", f"it holds {len(keys)} records")
    for key in sample_keys(keys):
        value = value_of(key)
        if value is None:
            continue
        try:
            found = claims(value, key, meta)
        except CorruptRecordError:
            continue
        where = f"record {key.decode('utf-8', 'replace')!r} holds"
        for name, agrees, truth in found:
            if not agrees:
                return lie(f"{name}={meta[name]}", f"{where} {truth}")
    return None
