"""Rows as memory-mapped columns: flat numpy files written once into a cache folder (keyed by the source
files, renamed into place, rebuilt when damaged) that loader workers map and share without copying."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, TypeVar

import numpy as np

log = logging.getLogger(__name__)

T = TypeVar("T")
FLUSH_ROWS = 1 << 16  # rows gathered in lists before they are appended to the column files
# read in steps of this many items through the file, not the map: a whole pass over a mapped column
# would leave all its pages counted in this process's RSS
STEP = 1 << 22


class Mapped(np.memmap):
    """A read-only column mapped from its file; pickled as its file name (a Ray worker maps it again)
    rather than as its bytes."""

    def __array_finalize__(self, obj) -> None:
        super().__array_finalize__(obj)
        self._whole = False  # a slice or a result computed from the column pickles as data

    def __getitem__(self, index):
        res = super().__getitem__(index)
        if isinstance(res, np.memmap) and res._mmap is None:  # a copy (fancy indexing): a plain array
            return res.view(np.ndarray)
        return res

    def __reduce__(self):
        if getattr(self, "_whole", False):
            return map_column, (self.filename, self.dtype.str, len(self))
        return np.asarray(self).copy().__reduce__()


def map_column(path: str | Path, dtype, count: int) -> np.ndarray:
    """`count` items of `dtype` in file `path`, mapped read-only (an empty column is a plain array)."""
    if count == 0:
        return np.zeros(0, dtype)
    arr = Mapped(path, dtype=dtype, mode="r", shape=(count,))
    arr._whole = True
    return arr


def source_key(paths: Sequence[str | Path], version: object) -> str:
    """sha256 of what converted columns depend on: their `version` and each file's resolved path, size,
    mtime and inode, in order."""
    ident = []
    for p in paths:
        info = os.stat(p)
        ident.append([str(Path(p).resolve()), info.st_size, info.st_mtime_ns, info.st_ino])
    return hashlib.sha256(json.dumps([version, ident]).encode()).hexdigest()


def new_folder(final: Path) -> Path:
    """A fresh hidden folder beside `final`, to be renamed to it, with the permissions the umask gives
    (`mkdtemp`'s would keep other users of a shared cache out)."""
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.mkdir()
    return tmp


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished folder `tmp` to `final`: readers see all of it or nothing."""
    try:
        os.rename(tmp, final)
    except OSError:  # another process (a torchrun rank) put it there first
        if not final.is_dir():
            raise


def cached_folder(
    final: Path, key: str, build: Callable[[Path], None], open_: Callable[[Path], T], what: str
) -> T:
    """`open_(final)` when `final` holds what `key` names (the opened object's `key`); else `build` it
    into a fresh folder, rename that into place and open it. A damaged or stale folder is built again."""
    if final.exists():
        if not final.is_dir() or stat.S_ISLNK(os.lstat(final).st_mode):
            raise ValueError(
                f"{what} cache {final} is not a folder; remove it or choose another cache folder"
            )
        try:
            found = open_(final)
            if found.key == key:
                return found
            problem = "for other files"
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problem = f"unreadable ({exc})"
        log.warning("%s cache %s is %s: converting again", what, final, problem)
        shutil.rmtree(final, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_folder(final)
    try:
        build(tmp)
        publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return open_(final)


class ArrayFolder:
    """Named 1-d arrays in a folder (`<name>.bin` each, `meta.json` with their dtypes, counts and key)."""

    def __init__(self, arrays: dict[str, np.ndarray], key: str):
        self.arrays, self.key = arrays, key

    @staticmethod
    def write(arrays: dict[str, np.ndarray], folder: Path, key: str) -> None:
        for name, arr in arrays.items():
            np.ascontiguousarray(arr).tofile(folder / f"{name}.bin")
        meta = {n: [a.dtype.str, len(a)] for n, a in arrays.items()}
        (folder / "meta.json").write_text(json.dumps({"key": key, "arrays": meta}))

    @classmethod
    def open(cls, folder: Path) -> ArrayFolder:
        meta = json.loads((folder / "meta.json").read_text())
        arrays = {}
        for name, (dtype, count) in meta["arrays"].items():
            path = folder / f"{name}.bin"
            if os.stat(path).st_size != np.dtype(dtype).itemsize * int(count):
                raise ValueError(f"{path}: not the {count} items recorded")
            arrays[name] = map_column(path, dtype, int(count))
        return cls(arrays, meta["key"])


def cached_arrays(
    cache_dir: str | Path | None,
    name: str,
    key: str,
    compute: Callable[[], dict[str, np.ndarray]],
    check: Callable[[dict[str, np.ndarray]], None],
) -> dict[str, np.ndarray]:
    """The arrays `compute()` gives, kept in `cache_dir`'s `<name>-<key>` and mapped from there
    (`check` raises ValueError for arrays that cannot be right: the folder is computed again); in
    memory without `cache_dir`."""
    if cache_dir is None:
        return compute()

    def opened(folder: Path) -> ArrayFolder:
        found = ArrayFolder.open(folder)
        check(found.arrays)
        return found

    def build(folder: Path) -> None:
        ArrayFolder.write(compute(), folder, key)

    return cached_folder(Path(cache_dir) / f"{name}-{key[:32]}", key, build, opened, name).arrays


# ---- rows of a fine-tuning split as columns
# A schema maps each field to its kind: a numpy dtype (one number per row), TEXT (a string per row: UTF-8
# bytes back to back with int64 `<name>_offsets`), TABLE (a hashable value or None per row: int32 index
# into the meta's table of distinct values, -1 for None; `Table("x")`: into table "x", shared with other
# fields), or a dict {part: dtype | TABLE} (a list of
# tuples per row, each part a flat column `<name>_<part>`, with int64 `<name>_offsets`).
@dataclass(frozen=True)
class Table:
    """A field of values kept as indices into a table; `name`: the table's (None: the field's own)."""

    name: str | None = None


TEXT, TABLE = "text", Table()


def _table_name(field: str, kind: Table) -> str:
    return kind.name or field


def _files(schema: dict) -> dict[str, np.dtype]:
    """The column files of `schema`: name -> dtype."""
    out: dict[str, np.dtype] = {}
    for name, kind in schema.items():
        if kind == TEXT:
            out[name], out[f"{name}_offsets"] = np.dtype(np.uint8), np.dtype(np.int64)
        elif isinstance(kind, Table):
            out[name] = np.dtype(np.int32)
        elif isinstance(kind, dict):
            for part, sub in kind.items():
                out[f"{name}_{part}"] = np.dtype(np.int32 if sub == TABLE else sub)
            out[f"{name}_offsets"] = np.dtype(np.int64)
        else:
            out[name] = np.dtype(kind)
    return out


def _tables(schema: dict) -> list[str]:
    """The names of `schema`'s value tables (a field's, or a list part's `<name>_<part>`)."""
    out = list(dict.fromkeys(_table_name(n, k) for n, k in schema.items() if isinstance(k, Table)))
    for name, kind in schema.items():
        if isinstance(kind, dict):
            out += [f"{name}_{part}" for part, sub in kind.items() if sub == TABLE]
    return out


class ColumnWriter:
    """Rows (dicts of `schema`'s fields) appended to column files in `directory`, a batch at a time."""

    def __init__(self, directory: Path, schema: dict):
        self.directory, self.schema = directory, schema
        self.dtypes = _files(schema)
        self.files = {n: open(directory / f"{n}.bin", "wb") for n in self.dtypes}  # noqa: SIM115
        self.counts = dict.fromkeys(self.dtypes, 0)
        self.tables: dict[str, dict] = {t: {} for t in _tables(schema)}
        self.ends = {n: 0 for n in self.dtypes if n.endswith("_offsets")}
        for name in self.ends:
            self._put(name, np.zeros(1, np.int64))
        self.pending: list[dict] = []
        self.rows = 0

    def _put(self, name: str, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values, dtype=self.dtypes[name])
        self.files[name].write(values.tobytes())
        self.counts[name] += len(values)

    def _index(self, table: str, value) -> int:
        if value is None:
            return -1
        return self.tables[table].setdefault(value, len(self.tables[table]))

    def _offsets(self, name: str, lengths: list[int]) -> None:
        ends = self.ends[name] + np.cumsum(np.array(lengths, np.int64))
        self._put(name, ends)
        self.ends[name] = int(ends[-1]) if len(ends) else self.ends[name]

    def add(self, row: dict) -> None:
        self.pending.append(row)
        if len(self.pending) >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        rows, self.pending = self.pending, []
        if not rows:
            return
        self.rows += len(rows)
        for name, kind in self.schema.items():
            values = [r[name] for r in rows]
            if kind == TEXT:
                encoded = [v.encode("utf-8") for v in values]
                self.files[name].write(b"".join(encoded))
                self.counts[name] += sum(map(len, encoded))
                self._offsets(f"{name}_offsets", [len(e) for e in encoded])
            elif isinstance(kind, Table):
                table = _table_name(name, kind)
                self._put(name, np.array([self._index(table, v) for v in values], np.int32))
            elif isinstance(kind, dict):
                for k, (part, sub) in enumerate(kind.items()):
                    flat = [item[k] for v in values for item in v]
                    if sub == TABLE:
                        flat = [self._index(f"{name}_{part}", x) for x in flat]
                    self._put(f"{name}_{part}", np.array(flat, self.dtypes[f"{name}_{part}"]))
                self._offsets(f"{name}_offsets", [len(v) for v in values])
            else:
                self._put(name, np.array(values, self.dtypes[name]))

    def close(self, key: str, version: int) -> None:
        self.flush()
        for fh in self.files.values():
            fh.close()
        meta = {
            "version": version,
            "key": key,
            "rows": self.rows,
            "counts": self.counts,
            "tables": {name: list(values) for name, values in self.tables.items()},
        }
        (self.directory / "meta.json").write_text(json.dumps(meta, ensure_ascii=False))


class Selection:
    """Columns (`columns`: name -> array) read through `rows`, the positions of the rows selected, in
    order (None: all, as written)."""

    columns: dict[str, np.ndarray]
    rows: np.ndarray | None

    def base(self, indices) -> np.ndarray:
        """Positions in the columns of rows `indices`."""
        indices = np.asarray(indices, dtype=np.int64)
        return indices if self.rows is None else self.rows[indices]

    def column(self, name: str) -> np.ndarray:
        """A per-row column over the selected rows (the mapped column itself when all are)."""
        col = self.columns[name]
        return col if self.rows is None else col[self.rows]


class RowColumns(Selection, Sequence):
    """A split's rows as columns of `SCHEMA`; `rows` selects and orders rows of the columns (None: all, as
    converted). A subclass builds its example object for item i on demand (`example`)."""

    SCHEMA: ClassVar[dict]
    KIND: ClassVar[str]  # the cache folder's prefix
    VERSION: ClassVar[int]  # bump when the columns change meaning
    IMAGES: ClassVar[tuple[str, ...]]  # the TABLE fields naming a row's images, in the example's order
    IMAGE_TABLE: ClassVar[str] = "image"  # the one table they all index

    def __init__(self, columns: dict[str, np.ndarray], meta: dict, rows: np.ndarray | None = None):
        self.columns, self.meta, self.rows = columns, meta, rows
        self.tables: dict[str, list] = meta["tables"]
        self.key: str = meta["key"]
        self._length = int(meta["rows"])
        self.directory: Path | None = None  # where the columns are mapped from

    # ---- writing and opening
    @classmethod
    def write(cls, records: Iterable[dict], directory: Path, key: str) -> None:
        writer = ColumnWriter(directory, cls.SCHEMA)
        try:
            for record in records:
                writer.add(record)
        finally:
            writer.close(key, cls.VERSION)

    @classmethod
    def open(cls, directory: str | Path):
        """The columns in `directory`, mapped; ValueError when they are not whole."""
        directory = Path(directory)
        meta = json.loads((directory / "meta.json").read_text(encoding="utf-8"))
        if meta.get("version") != cls.VERSION:
            raise ValueError(f"{directory}: converted by another version")
        columns = {}
        for name, dtype in _files(cls.SCHEMA).items():
            path = directory / f"{name}.bin"
            count = int(meta["counts"][name])
            size = os.stat(path).st_size
            if size != count * dtype.itemsize:
                raise ValueError(f"{path}: {size} bytes, not the {count} items recorded")
            columns[name] = map_column(path, dtype, count)
        found = cls(columns, meta)
        for name, kind in cls.SCHEMA.items():
            if kind == TEXT or isinstance(kind, dict):
                offsets = columns[f"{name}_offsets"]
                flat = _flat_count(columns, name, kind)
                if len(offsets) != len(found) + 1 or offsets[0] != 0 or offsets[-1] != flat:
                    raise ValueError(f"{directory}: {name}_offsets do not index {len(found)} rows")
            elif len(columns[name]) != len(found):
                count = len(columns[name])
                raise ValueError(f"{directory}: {name} holds {count} items for {len(found)} rows")
        found.directory = directory
        return found

    @classmethod
    def build(cls, records: Iterable[dict], key: str = ""):
        """`records` as columns in memory."""
        with tempfile.TemporaryDirectory(prefix=f"xmodal-{cls.KIND}-") as tmp:
            cls.write(records, Path(tmp), key)
            found = cls.open(tmp)
            return cls({k: np.array(v) for k, v in found.columns.items()}, found.meta)

    @classmethod
    def load(
        cls,
        records: Callable[[], Iterable[dict]],
        sources: Sequence[Path],
        cache_dir: str | Path | None,
        salt: object = None,
    ):
        """The rows `records()` gives for the files `sources`: converted once into `cache_dir` (keyed by
        the files' paths, sizes, mtimes and inodes, and `salt`: what else they depend on) and mapped from
        there. No `cache_dir`: in memory."""
        if cache_dir is None:
            return cls.build(records())
        key = source_key(sources, [cls.KIND, cls.VERSION, salt])
        final = Path(cache_dir) / f"{cls.KIND}-{key[:32]}"
        return cached_folder(final, key, lambda tmp: cls.write(records(), tmp, key), cls.open, cls.KIND)

    # ---- pickling: mapped columns travel as their folder (mapped again on arrival), a selection as data
    def __getstate__(self) -> dict:
        if self.directory is not None:
            return {"directory": str(self.directory), "rows": self.rows}
        return {"columns": self.columns, "meta": self.meta, "rows": self.rows}

    def __setstate__(self, state: dict) -> None:
        if "directory" in state:
            found = type(self).open(state["directory"])
            self.__init__(found.columns, found.meta, state["rows"])
            self.directory = found.directory
        else:
            self.__init__(state["columns"], state["meta"], state["rows"])

    # ---- rows
    def __len__(self) -> int:
        return self._length if self.rows is None else len(self.rows)

    def select(self, keep: np.ndarray):
        """The rows where boolean `keep` is set, in order."""
        return self._with_rows(self.base(np.nonzero(keep)[0]))

    def whole(self):
        """All rows of the columns, as converted."""
        return self._with_rows(None)

    def _with_rows(self, rows: np.ndarray | None):
        out = type(self)(self.columns, self.meta, rows)
        out.directory = self.directory
        return out

    def texts(self, name: str, indices) -> list[str]:
        """The strings of TEXT field `name` of rows `indices`."""
        offsets = self.columns[f"{name}_offsets"]
        blob = memoryview(np.asarray(self.columns[name]))  # slices without a memmap object each
        at = self.base(indices)
        spans = zip(offsets[at].tolist(), offsets[at + 1].tolist(), strict=True)
        return [str(blob[lo:hi], "utf-8") for lo, hi in spans]

    def values(self, name: str, indices) -> list:
        """The values of TABLE field `name` of rows `indices` (None where a row has none)."""
        table = self.tables[_table_name(name, self.SCHEMA[name])]
        return [None if i < 0 else table[i] for i in self.columns[name][self.base(indices)].tolist()]

    def items(self, name: str, i: int) -> list[tuple]:
        """The list of tuples of list field `name` of row i."""
        at = int(self.base(i))
        lo, hi = (int(x) for x in self.columns[f"{name}_offsets"][at : at + 2])
        parts = []
        for part, sub in self.SCHEMA[name].items():
            col = self.columns[f"{name}_{part}"][lo:hi].tolist()
            parts.append([self.tables[f"{name}_{part}"][x] for x in col] if sub == TABLE else col)
        return list(zip(*parts, strict=True))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.example(i % len(self))

    def example(self, i: int):
        raise NotImplementedError

    # ---- images
    @property
    def image_names(self) -> list[str]:
        return self.tables[self.IMAGE_TABLE]

    def image_indices(self) -> np.ndarray:
        """(rows, images per row) indices into `image_names` of the selected rows' images."""
        return np.stack([np.asarray(self.column(f)) for f in self.IMAGES], axis=1)

    def used_images(self) -> list[str]:
        """The names of the images the selected rows use, in first-use order."""
        flat = self.image_indices().ravel()
        uniq, first = np.unique(flat, return_index=True)
        names = self.image_names
        return [names[i] for i in uniq[np.argsort(first)].tolist()]

    def select_images(self, usable: np.ndarray):
        """The rows all of whose images are `usable` (a boolean per image name), in order."""
        return self.select(usable[self.image_indices()].all(axis=1))

    def image_ids(self, indices) -> list[str]:
        """Row by row, the image names of rows `indices` (all of a row's images, in order)."""
        names = self.image_names
        at = self.base(indices)
        cols = np.stack([self.columns[f][at] for f in self.IMAGES], axis=1)
        return [names[i] for i in cols.ravel().tolist()]


def _flat_count(columns: dict, name: str, kind) -> int:
    if kind == TEXT:
        return len(columns[name])
    return len(columns[f"{name}_{next(iter(kind))}"])


def text_chunks(text: np.ndarray, offsets: np.ndarray, chunk: int) -> Iterator[list[str]]:
    """Every string of a TEXT column (`text` bytes, `offsets`), `chunk` at a time; a mapped column is
    read through its file, not its map."""
    count = len(offsets) - 1
    if not isinstance(text, Mapped) or not isinstance(offsets, Mapped):
        for start in range(0, count, chunk):
            stop = min(start + chunk, count)
            lo, hi = int(offsets[start]), int(offsets[stop])
            data = bytes(text[lo:hi])
            cuts = (offsets[start : stop + 1] - lo).tolist()
            yield [data[a:b].decode("utf-8") for a, b in zip(cuts, cuts[1:], strict=False)]
        return
    with open(text.filename, "rb") as fh:
        for start in range(0, count, chunk):
            stop = min(start + chunk, count)
            cuts = np.fromfile(offsets.filename, np.int64, stop - start + 1, offset=start * 8)
            fh.seek(int(cuts[0]))
            data = fh.read(int(cuts[-1] - cuts[0]))
            cuts = (cuts - cuts[0]).tolist()
            yield [data[a:b].decode("utf-8") for a, b in zip(cuts, cuts[1:], strict=False)]
