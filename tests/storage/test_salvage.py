"""Salvage: `features verify` names what a damaged store lost and `features merge --salvage` copies every
record it still holds: a metadata count that lies, a data file cut short, a value pointing at another's."""

from __future__ import annotations

import json
import os
import struct

import lmdb
import numpy as np
import pytest

from pipelines.cli import main
from storage import FeatureReader, FeatureWriter
from storage.metadata import META_DB, META_KEY

COUNT = 300
PAGE = 4096


@pytest.fixture
def store(tmp_path, make_record):
    path = tmp_path / "s"
    with FeatureWriter(path, feature_dim=64) as w:
        for i in range(COUNT):
            w.put(make_record(i))
    return path


def _ids(indices):
    return [f"img_{i:06d}" for i in indices]


def _check_copy(path, kept, make_record, same):
    """`path` holds exactly the records `kept`, each equal to the one first written."""
    copy = FeatureReader(path)
    assert sorted(copy.keys()) == _ids(kept)
    for i in kept:
        same(copy[f"img_{i:06d}"], make_record(i), np.float16)


def _value_pointers(data: bytes, img_id: str) -> list[int]:
    """Where, in a data file, the leaf nodes of `img_id` (the live one and older copies) keep the number
    of its value's first page: the node header says the value lives on its own pages and the key is
    `img_id`, unlike the value itself, which also holds the id."""
    key = img_id.encode()
    found = []
    at = data.find(key)
    while at >= 0:
        _, _, flags, size = struct.unpack_from("<HHHH", data, at - 8)
        if flags & 0x01 and size == len(key):
            found.append(at + len(key))
        at = data.find(key, at + 1)
    assert found, f"no leaf node for {img_id}"
    return found


def _first_page(data: bytes, img_id: str) -> int:
    (page,) = {struct.unpack_from("<Q", data, at)[0] for at in _value_pointers(data, img_id)}
    return page


def test_a_count_that_lies_is_salvaged_whole(store, tmp_path, make_record, same, capsys, caplog):
    env = lmdb.open(str(store), max_dbs=2)
    with env.begin(write=True) as txn:
        db = env.open_db(META_DB, txn=txn)
        meta = json.loads(txn.get(META_KEY, db=db))
        meta["count"] = 400
        txn.put(META_KEY, json.dumps(meta).encode(), db=db)
    env.close()
    assert main(["features", "verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert (
        f"metadata count 400 but {COUNT} records are readable" in out
        and f"{COUNT} records checked, 0 bad" in out
    )
    assert main(["features", "merge", str(store), str(tmp_path / "refused")]) == 1
    assert "merge --salvage" in caplog.text  # the refusal says how to get the records out
    assert main(["features", "merge", "--salvage", str(store), str(tmp_path / "m")]) == 0
    assert f"{COUNT} records written" in capsys.readouterr().out
    _check_copy(tmp_path / "m", range(COUNT), make_record, same)


@pytest.mark.parametrize("pages", [1, 3, 7])
def test_a_data_file_cut_short_is_salvaged(pages, store, tmp_path, make_record, same, capsys):
    data = store / "data.mdb"
    raw = data.read_bytes()
    values = {i: _first_page(raw, f"img_{i:06d}") for i in range(COUNT)}
    os.truncate(data, data.stat().st_size - pages * PAGE)
    last = data.stat().st_size // PAGE - 1
    # an independent count: a record survives when both pages of its value lie inside the cut file
    kept = [i for i in range(COUNT) if values[i] + 1 <= last]
    lost = sorted(set(range(COUNT)) - set(kept))
    assert main(["features", "verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert "is truncated" in out and f"{len(kept)} records checked, 0 bad" in out
    assert all(f"the value of 'img_{i:06d}'" in out for i in lost)
    expected = 2 if lost else 0  # EXIT_PARTIAL when records were left out
    assert main(["features", "merge", "--salvage", str(store), str(tmp_path / "m")]) == expected
    _check_copy(tmp_path / "m", kept, make_record, same)


def test_a_value_pointing_at_another_records_pages(store, tmp_path, make_record, same, capsys):
    data = bytearray((store / "data.mdb").read_bytes())
    other = struct.pack("<Q", _first_page(data, "img_000151"))
    for at in _value_pointers(data, "img_000150"):
        data[at : at + 8] = other
    (store / "data.mdb").write_bytes(bytes(data))
    assert main(["features", "verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert "BAD img_000150: record stored under b'img_000150' carries img_id 'img_000151'" in out
    assert f"{COUNT} records checked, 1 bad" in out
    assert main(["features", "merge", "--salvage", str(store), str(tmp_path / "m")]) == 2
    _check_copy(tmp_path / "m", [i for i in range(COUNT) if i != 150], make_record, same)
