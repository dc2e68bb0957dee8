"""Crash safety and concurrency: SIGKILL mid-write, a reader beside a live writer, fork/spawn workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from storage import FeatureReader, StoreFormatError
from storage.verify import verify

REPO = Path(__file__).resolve().parents[2]
CONFTEST = Path(__file__).with_name("conftest.py")

# A writer process: records start..stop-1 (the same `record(i)` as the tests), committed every 5.
WRITER = """
import sys, time
from storage import FeatureWriter
exec(compile(open(sys.argv[1]).read(), "conftest", "exec"))
path, pause = sys.argv[2], float(sys.argv[5])
start, stop, map_size, dim = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[6]), int(sys.argv[7])
with FeatureWriter(path, feature_dim=dim, commit_every=5, map_size=map_size) as w:
    for i in range(start, stop):
        w.put(record(i, feature_dim=dim))
        time.sleep(pause)
"""


def start_writer(path, start, stop, pause=0.0, map_size=1 << 30, dim=512) -> subprocess.Popen:
    """Records start..stop-1 of `dim`-d features, written by another process."""
    args = [sys.executable, "-c", WRITER, str(CONFTEST), str(path)]
    args += [str(start), str(stop), str(pause), str(map_size), str(dim)]
    return subprocess.Popen(args, cwd=REPO, stderr=subprocess.PIPE, text=True)


def count(path) -> int:
    """Committed records, 0 while the writer has not created the store yet."""
    r = FeatureReader(path, lock=True)
    try:
        return r.meta["count"]
    except (FileNotFoundError, StoreFormatError):
        return 0
    finally:
        r.close()


def test_sigkill_mid_write_loses_only_the_open_batch(tmp_path, make_record, same):
    path = tmp_path / "s"
    proc = start_writer(path, 0, 10_000, pause=0.002)
    deadline = time.monotonic() + 300  # a writer starting on a loaded machine (imports) can take a minute
    while count(path) < 23 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    report = verify(path)
    assert report.ok, (report.bad, report.problems)
    r = FeatureReader(path)
    ids = list(r.keys())
    assert len(ids) >= 25 and len(ids) % 5 == 0  # whole batches only
    assert ids == [f"img_{i:06d}" for i in range(len(ids))]
    for i in (0, len(ids) // 2, len(ids) - 1):
        same(r[ids[i]], make_record(i, feature_dim=512), np.float16)
    r.close()

    rerun = start_writer(path, 0, len(ids) + 12)
    assert rerun.wait(60) == 0, rerun.stderr.read()
    r = FeatureReader(path)
    assert list(r.keys()) == [f"img_{i:06d}" for i in range(len(ids) + 12)]
    assert r.meta["count"] == len(ids) + 12
    same(r[f"img_{len(ids) + 11:06d}"], make_record(len(ids) + 11, feature_dim=512), np.float16)
    assert verify(path).ok


def test_reader_beside_a_writer_that_commits_and_grows_the_map(tmp_path, make_record, same):
    path = tmp_path / "s"
    proc = start_writer(path, 0, 60, pause=0.003, map_size=256 << 10)
    while not count(path) and proc.poll() is None:
        time.sleep(0.01)
    r = FeatureReader(path, lock=True)
    seen = set()
    while True:
        done = proc.poll() is not None
        for img_id in list(r.keys()):
            if img_id not in seen:
                same(r[img_id], make_record(int(img_id[4:]), feature_dim=512), np.float16)
                seen.add(img_id)
        if done:
            break
    assert proc.returncode == 0, proc.stderr.read()
    assert len(seen) == 60 and len(r) == 60 and r.meta["count"] == 60


def test_reader_adopts_a_map_grown_by_another_process(tmp_path, make_record, same):
    path = tmp_path / "s"
    assert start_writer(path, 0, 1, dim=2048).wait(60) == 0
    r = FeatureReader(path, lock=True)
    assert len(r) == 1  # opened with a map of about 10 MB
    assert start_writer(path, 1, 90, map_size=1 << 20, dim=2048).wait(60) == 0  # the file grows to ~14 MB
    assert len(r) == 90
    same(r["img_000089"], make_record(89, feature_dim=2048), np.float16)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_read_the_right_records(tmp_path, make_record, same, method):
    torch = pytest.importorskip("torch")
    from storage import FeatureWriter

    recs = [make_record(i, num_boxes=1 + i % 36) for i in range(24)]
    with FeatureWriter(tmp_path / "s", feature_dim=64) as w:
        for rec in recs:
            w.put(rec)
    reader = FeatureReader(tmp_path / "s")
    ids = list(reader.keys())[::-1]  # the parent opened the store before the workers start
    loader = torch.utils.data.DataLoader(
        reader, sampler=ids, batch_size=5, num_workers=2, collate_fn=list, multiprocessing_context=method
    )
    got = [rec for batch in loader for rec in batch]
    assert [rec.img_id for rec in got] == ids
    by_id = {rec.img_id: rec for rec in recs}
    for rec in got:
        same(rec, by_id[rec.img_id], np.float16)


def test_forked_child_reopens_its_own_environment(tmp_path, make_record, same):
    from storage import FeatureWriter

    with FeatureWriter(tmp_path / "s", feature_dim=64) as w:
        w.put(make_record(0))
    r = FeatureReader(tmp_path / "s")
    parent_env = r.shards[0].env
    pid = os.fork()
    if pid == 0:
        ok = r.shards[0].env is not parent_env and r["img_000000"].img_id == "img_000000"
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    same(r["img_000000"], make_record(0), np.float16)
