"""The image-token store: one LMDB environment holding a DALL-E token grid per image (FORMAT.md, "Image
token store"). Its metadata names its own format, so region readers and token readers refuse each other."""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from storage.contents import contents_lie
from storage.environment import StoreDamagedError, lmdb, lmdb_failure, open_environment
from storage.errors import CorruptRecordError, StoreFormatError
from storage.file_checks import parse_json
from storage.metadata import META_DB, META_KEY, RECORDS_DB, _user

TOKEN_FORMAT_NAME = "xmodal-image-tokens"
TOKEN_FORMAT_VERSION = 1
MAGIC = b"XMIT"
LAYOUT = 1
# magic, layout, reserved, id length, rows, columns, CRC-32 of the value without these 4 bytes
HEADER = struct.Struct("<4sBBHHHI")
MAX_CODEBOOK = 1 << 16  # tokens are stored as uint16
MAX_GRID = (1 << 16) - 1  # and the header holds rows and cols as uint16


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def encode_tokens(img_id: str, grid: np.ndarray) -> bytes:
    """One record value: header, the id padded to 8 bytes, then the grid as little-endian uint16."""
    key = img_id.encode("utf-8")
    rows, cols = grid.shape
    body = key.ljust(_pad8(len(key)), b"\0") + np.ascontiguousarray(grid, dtype="<u2").tobytes()
    head = HEADER.pack(MAGIC, LAYOUT, 0, len(key), rows, cols, 0)
    crc = zlib.crc32(body, zlib.crc32(head[:-4]))
    return HEADER.pack(MAGIC, LAYOUT, 0, len(key), rows, cols, crc) + body


def decode_tokens(value: bytes, key: str, path: Path) -> np.ndarray:
    """The (rows, cols) int64 grid of a record value; a damaged value is a CorruptRecordError."""
    where = f"{path}: record {key!r}"
    if len(value) < HEADER.size:
        raise CorruptRecordError(f"{where} is {len(value)} bytes, shorter than its header; re-tokenize it")
    magic, layout, _, length, rows, cols, crc = HEADER.unpack_from(value)
    if magic != MAGIC or layout != LAYOUT:
        raise CorruptRecordError(f"{where}: not an image-token record (magic {magic!r}, layout {layout})")
    start = HEADER.size + _pad8(length)
    if len(value) != start + 2 * rows * cols:
        raise CorruptRecordError(f"{where}: {len(value)} bytes do not hold a {rows} x {cols} grid")
    if zlib.crc32(value[HEADER.size :], zlib.crc32(value[: HEADER.size - 4])) != crc:
        raise CorruptRecordError(f"{where}: checksum mismatch, the record is damaged; re-tokenize it")
    return np.frombuffer(value, dtype="<u2", offset=start).reshape(rows, cols).astype(np.int64)


def _check_meta(raw: bytes | None, path: Path) -> dict:
    if raw is None:
        raise StoreFormatError(f"{path}: no metadata record: not an xmodal store")
    fix = "the store is damaged; write it again with `xmodal generate tokenize`"
    meta = parse_json(raw, f"{path}: metadata record", fix)
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != TOKEN_FORMAT_NAME:
        raise StoreFormatError(
            f"{path} is an {found!r} store, not an {TOKEN_FORMAT_NAME} store: give the store "
            "written by `xmodal generate tokenize`"
        )
    version = meta.get("format_version")
    if not isinstance(version, int) or version > TOKEN_FORMAT_VERSION:
        raise StoreFormatError(
            f"{path}: image-token format version {version!r}; this xmodal reads up to "
            f"{TOKEN_FORMAT_VERSION}: upgrade xmodal to read it"
        )
    for key, low, high in (("grid", 1, MAX_GRID), ("codebook_size", 1, MAX_CODEBOOK), ("count", 0, None)):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low or (high and value > high):
            allowed = f"an integer >= {low}" + (f" and <= {high}" if high else "")
            raise StoreFormatError(
                f"{path}: metadata record says {key}={value!r}, which must be {allowed}: {fix}"
            )
    return meta


TOKEN_REMEDY = "write it again with `xmodal generate tokenize`"


def _token_claims(value: bytes, key: bytes, meta: dict) -> list[tuple[str, bool, str]]:
    """(metadata key, whether the token record agrees, what it holds), for `storage.contents`."""
    if len(value) < HEADER.size:
        raise CorruptRecordError(f"record {key!r} is shorter than its header")
    magic, layout, _, _, rows, cols, _ = HEADER.unpack_from(value)
    if magic != MAGIC or layout != LAYOUT:
        raise CorruptRecordError(f"record {key!r} is not an image-token record")
    return [("grid", rows == cols == meta["grid"], f"a {rows} x {cols} grid")]


class TokenWriter:
    """Appends token grids to a store (opening an existing one resumes it: ids present are skipped).

    Commits every `commit_every` records, rewriting the metadata's count in the same transaction, so a
    crash loses at most the uncommitted batch.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        grid: int,
        codebook_size: int,
        provenance: dict | None = None,
        commit_every: int = 256,
    ) -> None:
        if not 2 <= codebook_size <= MAX_CODEBOOK:
            raise ValueError(f"codebook_size {codebook_size} must lie in [2, {MAX_CODEBOOK}]")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.commit_every = max(1, commit_every)
        self._env = open_environment(self.path, map_size=1 << 30, max_dbs=2, readahead=False)
        self._txn = self._env.begin(write=True)
        self._records = self._env.open_db(RECORDS_DB, txn=self._txn)
        self._meta_db = self._env.open_db(META_DB, txn=self._txn)
        raw = self._txn.get(META_KEY, db=self._meta_db)
        if raw is None:
            self.meta = {
                "format": TOKEN_FORMAT_NAME,
                "format_version": TOKEN_FORMAT_VERSION,
                "grid": int(grid),
                "codebook_size": int(codebook_size),
                "count": 0,
                "created_by": _user(),
                "provenance": dict(provenance or {}),
            }
            self._put_meta()
        else:
            self.meta = _check_meta(raw, self.path)
            keys = [bytes(k) for k in self._txn.cursor(db=self._records).iternext(values=False)]
            lie = contents_lie(
                self.path,
                self.meta,
                keys,
                lambda key: self._txn.get(key, db=self._records),
                claims=_token_claims,
                remedy=TOKEN_REMEDY,
            )
            if lie is not None:  # a resumed count starts from the metadata's: it must be true
                self._txn.abort()
                self._env.close()
                raise StoreDamagedError(lie)
            if (self.meta["grid"], self.meta["codebook_size"]) != (grid, codebook_size):
                self._txn.abort()
                self._env.close()
                raise StoreFormatError(
                    f"{self.path} holds {self.meta['grid']} x {self.meta['grid']} grids of "
                    f"{self.meta['codebook_size']} codes, not {grid} x {grid} of {codebook_size}: "
                    "write to a new --out"
                )
        self._pending = 0

    def _put_meta(self) -> None:
        self._txn.put(META_KEY, json.dumps(self.meta, sort_keys=True).encode(), db=self._meta_db)

    def __contains__(self, img_id: str) -> bool:
        return self._txn.get(img_id.encode("utf-8"), db=self._records) is not None

    def put(self, img_id: str, grid: np.ndarray) -> bool:
        """Write one grid; False (nothing written) when the id is already stored."""
        g = self.meta["grid"]
        if grid.shape != (g, g):
            raise ValueError(f"{img_id!r}: token grid of shape {grid.shape}, the store holds ({g}, {g})")
        if grid.size and (grid.min() < 0 or grid.max() >= self.meta["codebook_size"]):
            raise ValueError(f"{img_id!r}: tokens outside [0, {self.meta['codebook_size']})")
        value = encode_tokens(img_id, grid)
        try:
            if not self._txn.put(img_id.encode("utf-8"), value, db=self._records, overwrite=False):
                return False
        except lmdb.MapFullError as exc:
            raise lmdb_failure(self.path, exc, "writing a record") from exc
        self.meta["count"] += 1
        self._pending += 1
        if self._pending >= self.commit_every:
            self.commit()
        return True

    def commit(self) -> None:
        self._put_meta()
        self._txn.commit()
        self._txn = self._env.begin(write=True)
        self._pending = 0

    def close(self) -> None:
        if self._txn is not None:
            self.commit()
            self._txn.abort()
            self._txn = None
            self._env.close()

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TokenReader:
    """Reads a finished token store: `reader[img_id]` is the (grid, grid) int64 token grid."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not (self.path / "data.mdb").is_file():
            raise StoreFormatError(f"{self.path}: no data.mdb: not an xmodal store")
        self._env = open_environment(self.path, readonly=True, lock=False, max_dbs=2, readahead=False)
        try:
            self._records = self._env.open_db(RECORDS_DB, create=False)
            meta_db = self._env.open_db(META_DB, create=False)
        except lmdb.Error as exc:
            self._env.close()
            raise StoreFormatError(f"{self.path}: no records/meta databases: not an xmodal store") from exc
        try:
            with self._env.begin() as txn:
                self.meta = _check_meta(txn.get(META_KEY, db=meta_db), self.path)
                # the metadata sizes the dataset and the model's token table: it must tell the truth
                # (the same check, by the same function, as every region-store reader runs)
                keys = [bytes(k) for k in txn.cursor(db=self._records).iternext(values=False)]
                lie = contents_lie(
                    self.path,
                    self.meta,
                    keys,
                    lambda key: txn.get(key, db=self._records),
                    claims=_token_claims,
                    remedy=TOKEN_REMEDY,
                )
            if lie is not None:
                raise StoreDamagedError(lie)
        except (StoreFormatError, StoreDamagedError):
            self._env.close()
            raise

    @property
    def grid(self) -> int:
        return int(self.meta["grid"])

    @property
    def codebook_size(self) -> int:
        return int(self.meta["codebook_size"])

    def __len__(self) -> int:
        return int(self.meta["count"])

    def __contains__(self, img_id: str) -> bool:
        with self._env.begin(db=self._records) as txn:
            return txn.get(img_id.encode("utf-8")) is not None

    def __getitem__(self, img_id: str) -> np.ndarray:
        with self._env.begin(db=self._records) as txn:
            value = txn.get(img_id.encode("utf-8"))
            if value is None:
                raise KeyError(f"{self.path}: no token grid for image {img_id!r}; tokenize it first")
            return decode_tokens(bytes(value), img_id, self.path)

    def keys(self) -> Iterator[str]:
        with self._env.begin(db=self._records) as txn:
            for key in txn.cursor().iternext(values=False):
                yield bytes(key).decode("utf-8")

    def close(self) -> None:
        self._env.close()
