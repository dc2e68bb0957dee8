"""Broken B-tree pages: found by the walk, reported per page by verify, never taken for missing ids.

Pages are damaged by hand in the file: a zeroed page (what a crash or a bad disk leaves) and a pointer
past the end of the file. Operations that could reach lmdb's cursor run in a child process: lmdb aborts
the process when a cursor steps onto a broken page, and a regression must fail the test, not pytest."""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

from storage import FeatureReader, FeatureWriter, RegionFeatures
from storage.btree import walk_records
from storage.environment import StoreDamagedError
from storage.merge import merge_stores
from storage.verify import verify

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = 4096
COUNT = 600


def small(i: int) -> RegionFeatures:
    """One box of 8 features: ~100 bytes, so the values sit in the leaves and a leaf holds ~30 ids."""
    rng = np.random.default_rng(i)
    return RegionFeatures(
        img_id=f"img_{i:06d}",
        img_h=50,
        img_w=60,
        boxes=np.array([[1, 2, 30, 40]], np.float32),
        features=rng.random((1, 8)).astype(np.float32),
        objects_id=np.array([3]),
        objects_conf=np.array([0.5], np.float32),
        attrs_id=np.array([4]),
        attrs_conf=np.array([0.25], np.float32),
    )


def pages(path) -> list[tuple[int, int, bytes]]:
    """(page number, flags, bytes) of every page of data.mdb, read independently of storage.btree."""
    data = (path / "data.mdb").read_bytes()
    return [
        (i, struct.unpack_from("<H", data, i * PAGE + 10)[0], data[i * PAGE : (i + 1) * PAGE])
        for i in range(len(data) // PAGE)
    ]


def leaf_ids(page: bytes) -> list[str]:
    """The ids a leaf page holds, from its node offsets (lmdb's layout: 16-byte header, u16 offsets)."""
    lower = struct.unpack_from("<H", page, 12)[0]
    ids = []
    for k in range((lower - 16) // 2):
        ptr = struct.unpack_from("<H", page, 16 + 2 * k)[0]
        ksize = struct.unpack_from("<H", page, ptr + 6)[0]
        ids.append(page[ptr + 8 : ptr + 8 + ksize].decode())
    return ids


@pytest.fixture(params=["zeroed", "random bytes", "another leaf"])
def damaged(tmp_path, request):
    """A store with one records leaf zeroed, overwritten with noise, or overwritten with a copy of another
    leaf under its own page number (sound to lmdb, which then silently misses its ids): returns the path
    and the ids the leaf held."""
    path = tmp_path / "s"
    with FeatureWriter(path, feature_dim=8, max_boxes=4) as w:
        for i in range(COUNT):
            w.put(small(i))
    leaves = [(n, p) for n, flags, p in pages(path) if flags & 0x02 and b"img_" in p]
    number, page = leaves[len(leaves) // 2]
    lost = leaf_ids(page)
    with open(path / "data.mdb", "r+b") as f:
        f.seek(number * PAGE)
        if request.param == "zeroed":
            f.write(bytes(PAGE))
        elif request.param == "random bytes":
            f.write(np.random.default_rng(0).bytes(PAGE))
        else:
            f.write(struct.pack("<Q", number) + leaves[0][1][8:])
    return path, lost


def test_walk_finds_the_zeroed_leaf_and_every_other_id(damaged):
    path, lost = damaged
    walk = walk_records(path / "data.mdb", b"records")
    assert len(walk.broken) == 1 and re.search("overwritten or zeroed|out of order", walk.broken[0].reason)
    everyone = [f"img_{i:06d}" for i in range(COUNT)]
    assert [k.decode() for k in walk.keys] == [i for i in everyone if i not in lost]
    # the broken page's key range covers exactly the ids it held, among all ids
    assert [i for i in everyone if walk.broken[0].holds(i.encode())] == lost


def test_a_sound_store_walks_clean(tmp_path):
    with FeatureWriter(tmp_path / "s", feature_dim=8, max_boxes=4) as w:
        for i in range(COUNT):
            w.put(small(i))
    walk = walk_records(tmp_path / "s" / "data.mdb", b"records", values=True)
    assert not walk.broken and len(walk.keys) == COUNT


def test_lookups_tell_damage_from_a_missing_id(damaged):
    path, lost = damaged
    reader = FeatureReader(path)
    kept = next(i for i in (f"img_{k:06d}" for k in range(COUNT)) if i not in lost)
    assert reader[kept].img_id == kept
    for img_id in (lost[0], lost[len(lost) // 2], lost[-1]):
        with pytest.raises(StoreDamagedError, match=f"store {path} is damaged.*features verify"):
            img_id in reader  # noqa: B015
        with pytest.raises(StoreDamagedError, match="is damaged"):
            reader[img_id]
    # an id that was never stored, outside the broken page's range, is simply missing
    assert "zzz_never_stored" not in reader and reader.get("zzz_never_stored") is None


def test_scans_refuse_a_damaged_store(damaged):
    path, lost = damaged
    with pytest.raises(StoreDamagedError, match=f"from {lost[0]!r}.*cannot be read"):
        list(FeatureReader(path).keys())
    with pytest.raises(StoreDamagedError, match="is damaged"):
        FeatureWriter(path, feature_dim=8, max_boxes=4)


def test_verify_reports_the_lost_range_and_checks_the_rest(damaged):
    path, lost = damaged
    report = verify(path)
    assert report.checked == COUNT - len(lost) and not report.bad and not report.ok
    assert report.damaged == [str(path)]
    assert f"from {lost[0]!r}" in report.problems[0]
    assert re.search("overwritten or zeroed|out of order", report.problems[0])
    assert f"metadata count {COUNT} but {COUNT - len(lost)} records are readable" in report.problems[1]


@pytest.mark.parametrize("command", ["verify", "merge", "info"])
def test_cli_on_a_damaged_store_in_a_child_process(damaged, tmp_path, command):
    path, lost = damaged
    args = [str(path), str(tmp_path / "out")] if command == "merge" else [str(path)]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", "features", command, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode not in (-signal.SIGABRT, -signal.SIGBUS, -signal.SIGSEGV), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    if command == "info":  # the metadata is intact: info describes the store, with a warning
        assert proc.returncode == 0 and "is damaged" in proc.stderr
    elif command == "verify":
        assert proc.returncode == 1
        assert f"PROBLEM {path}: the records from {lost[0]!r}" in proc.stdout
        assert f"{COUNT - len(lost)} records checked, 0 bad" in proc.stdout
    else:
        assert proc.returncode == 1 and "is damaged" in proc.stderr and "features verify" in proc.stderr


def test_a_value_page_pointing_past_the_file(tmp_path, make_record):
    """Large values live on overflow pages; a leaf pointing one past the last page loses that record only."""
    path = tmp_path / "s"
    with FeatureWriter(path, feature_dim=64) as w:
        for i in range(6):
            w.put(make_record(i))
    data = bytearray((path / "data.mdb").read_bytes())
    target = b"img_000002"
    at = data.index(target)  # the leaf node's key; the overflow page number follows it
    struct.pack_into("<Q", data, at + len(target), 10**6)
    (path / "data.mdb").write_bytes(bytes(data))
    report = verify(path)
    assert report.checked == 5 and "the value of 'img_000002'" in report.problems[0]
    with pytest.raises(StoreDamagedError, match="is damaged"):
        FeatureReader(path)["img_000002"]
    assert FeatureReader(path)["img_000003"].img_id == "img_000003"


@pytest.mark.parametrize("page", ["main database root", "metadata"])
def test_a_store_whose_databases_cannot_be_read(tmp_path, page):
    """Zeroing the page naming the databases, or the one holding the metadata, leaves nothing readable:
    every command says so in one line (and does not send the user to `verify`, which cannot read it)."""
    path = tmp_path / "s"
    with FeatureWriter(path, feature_dim=8, max_boxes=4) as w:
        for i in range(20):
            w.put(small(i))
    marks = (b"records", b"meta") if page == "main database root" else (b"xmodal-region-features",)
    victims = [n for n, flags, p in pages(path) if n > 1 and flags & 0x02 and all(m in p for m in marks)]
    with open(path / "data.mdb", "r+b") as f:
        for number in victims:  # the live copy and any older one
            f.seek(number * PAGE)
            f.write(bytes(PAGE))
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    for command in ("info", "verify"):
        proc = subprocess.run(
            [sys.executable, "-m", "pipelines.cli", "features", command, str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert f"store {path} is damaged" in last and "nothing in it can be read" in last


def test_merge_salvages_what_a_damaged_store_still_holds(damaged, tmp_path, caplog):
    path, lost = damaged
    with pytest.raises(StoreDamagedError, match="is damaged"):
        merge_stores([path], tmp_path / "refused")
    with caplog.at_level("WARNING", logger="storage.merge"):
        merged = merge_stores([path], tmp_path / "saved", salvage=True)
    assert merged.written == COUNT - len(lost) and verify(tmp_path / "saved").ok
    assert merged.left_out == [r.getMessage() for r in caplog.records]
    saved = FeatureReader(tmp_path / "saved")
    assert sorted(saved.keys()) == [f"img_{i:06d}" for i in range(COUNT) if f"img_{i:06d}" not in lost]
    np.testing.assert_array_equal(saved["img_000000"].features, small(0).features.astype(np.float16))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"from {lost[0]!r}" in warnings[0] and "left out" in warnings[0]
