"""The file formats region features come in and go out as: one table, name -> suffixes, reader, writer."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from storage import hdf5, tsv
from storage.errors import BadInputError
from storage.records import RegionFeatures

Items = Iterator[tuple[str, RegionFeatures | BadInputError]]


@dataclass(frozen=True)
class Format:
    """`read(path, **read_options) -> (where, record or error)` items; `write(reader, path,
    **write_options) -> records written`; `describe(path)` what an import records in the store's
    provenance; `max_boxes(path)` the widest record, when the file knows it; `source_provenance(path)`
    what produced the features, when the file says."""

    name: str
    suffixes: tuple[str, ...]
    read: Callable[..., Items]
    write: Callable[..., int]
    read_options: tuple[str, ...] = ()
    write_options: tuple[str, ...] = ()
    describe: Callable[[str | os.PathLike], dict] = field(default=lambda path: {})
    max_boxes: Callable[[str | os.PathLike], int] | None = None
    # what produced the features, when the file says (an xmodal HDF5 export): the new store's provenance
    source_provenance: Callable[[str | os.PathLike], dict] = field(default=lambda path: {})


FORMATS: dict[str, Format] = {
    "tsv": Format(
        "tsv",
        (".tsv", ".csv"),
        read=tsv.read_tsv,
        write=tsv.export_tsv,
        write_options=("skip_empty",),
        describe=lambda path: {"layout": tsv.tsv_layout(path)},
        max_boxes=tsv.tsv_max_boxes,
    ),
    "hdf5": Format(
        "hdf5",
        (".h5", ".hdf5"),
        read=hdf5.read_hdf5,
        write=hdf5.export_hdf5,
        read_options=("ids",),
        write_options=("dtype",),
        max_boxes=hdf5.hdf5_max_boxes,
        source_provenance=hdf5.hdf5_source_provenance,
    ),
}


def format_of(path: str | os.PathLike, name: str | None = None) -> Format:
    """The format `name` names, else the one `path`'s extension belongs to."""
    if name is not None:
        if name not in FORMATS:
            raise ValueError(f"unknown feature format {name!r}; choose one of {sorted(FORMATS)}")
        return FORMATS[name]
    suffix = Path(path).suffix.lower()
    for fmt in FORMATS.values():
        if suffix in fmt.suffixes:
            return fmt
    known = sorted(s for fmt in FORMATS.values() for s in fmt.suffixes)
    raise ValueError(f"cannot tell the format of {path} from its name: use {', '.join(known)}, or --format")


def options_for(fmt: Format, given: dict, allowed: tuple[str, ...], what: str) -> dict:
    """The options `fmt` takes; one it does not take but was given is refused, naming the format."""
    unused = sorted(k for k, v in given.items() if v not in (None, False) and k not in allowed)
    if unused:
        flags = ", ".join("--" + k.replace("_", "-") for k in unused)
        raise ValueError(f"{flags} does not apply to {fmt.name} {what}")
    return {k: v for k, v in given.items() if k in allowed and v is not None}
