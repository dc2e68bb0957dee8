"""The store's own files and JSON records: a manifest that is a FIFO, a device, a directory, huge or nested
past the parser, and metadata records that nest too deeply or lie about their shapes, are one line each."""

from __future__ import annotations

import json
import os
import sys

import lmdb
import pytest

from storage import FeatureReader, FeatureWriter
from storage.errors import StoreFormatError
from storage.file_checks import MANIFEST_LIMIT
from storage.metadata import META_DB, META_KEY
from storage.shards import MANIFEST, expand, read_manifest, write_manifest
from storage.token_store import TokenReader, TokenWriter

DEEP = ("[" * 100_000 + "]" * 100_000).encode()


def _one_line(info: pytest.ExceptionInfo, *needles: str) -> None:
    text = str(info.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, text


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "huge", "deep", "not json"])
def test_a_manifest_that_cannot_be_one(kind, tmp_path):
    root = tmp_path / "set"
    write_manifest(root, {}, "job-1")
    manifest = root / MANIFEST
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)  # reading it would wait for a writer forever
    elif kind == "device":
        manifest.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "directory":
        manifest.mkdir()
    elif kind == "huge":
        with open(manifest, "wb") as fh:
            fh.truncate(MANIFEST_LIMIT + 1)  # sparse: no disk used
    elif kind == "deep":
        manifest.write_bytes(DEEP)
    else:
        manifest.write_bytes(b"\xff{")
    expected = {
        "fifo": "not a regular file",
        "device": "not a regular file",
        "directory": "is a directory",
        "huge": f"more than such a file can be ({MANIFEST_LIMIT})",
        "deep": "nested too deeply",
        "not json": "not valid JSON",
    }[kind]
    with pytest.raises(StoreFormatError) as info:
        read_manifest(root)
    _one_line(info, str(manifest), expected, "restore it or re-extract the set")
    with pytest.raises(StoreFormatError) as info:  # wherever a store path is taken
        expand([root])
    _one_line(info, expected)


def _set_meta(path, raw: bytes) -> None:
    env = lmdb.open(str(path), max_dbs=4, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(META_KEY, raw, db=env.open_db(META_DB, txn=txn))
    env.close()


def test_region_metadata_nested_too_deeply(tmp_path):
    store = tmp_path / "f.lmdb"
    FeatureWriter(store, feature_dim=4, max_boxes=2, dtype="float32").close()
    _set_meta(store, DEEP)
    assert sys.getrecursionlimit() < 100_000  # the parser would overflow without the check
    with pytest.raises(StoreFormatError) as info:
        dict(FeatureReader(store).meta)
    _one_line(info, "metadata record is JSON nested too deeply", f"xmodal features verify {store}")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"grid": "abc"}, "grid='abc', which must be an integer >= 1"),
        ({"grid": None}, "grid=None"),
        ({"grid": 1 << 20}, "and <= 65535"),
        ({"codebook_size": 0}, "codebook_size=0"),
        ({"count": -1}, "count=-1, which must be an integer >= 0"),
        ({"count": True}, "count=True"),
    ],
)
def test_token_store_metadata_that_lies(change, needle, tmp_path):
    store = tmp_path / "t"
    TokenWriter(store, grid=2, codebook_size=10).close()
    env = lmdb.open(str(store), max_dbs=4, subdir=True)
    with env.begin() as txn:
        meta = json.loads(txn.get(META_KEY, db=env.open_db(META_DB, txn=txn)))
    env.close()
    _set_meta(store, json.dumps({**meta, **change}).encode())
    with pytest.raises(StoreFormatError) as info:
        TokenReader(store)
    _one_line(info, str(store), needle, "xmodal generate tokenize")


@pytest.mark.parametrize(("raw", "needle"), [(DEEP, "nested too deeply"), (b"[1, 2]", "an None store")])
def test_token_store_metadata_that_is_not_a_record(raw, needle, tmp_path):
    store = tmp_path / "t"
    TokenWriter(store, grid=2, codebook_size=10).close()
    _set_meta(store, raw)
    with pytest.raises(StoreFormatError) as info:
        TokenReader(store)
    _one_line(info, str(store), needle)
