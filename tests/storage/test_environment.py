"""Truncated, emptied and foreign `data.mdb` files end in one clear line, never SIGBUS or a traceback.

Every operation runs in a child process: reading a page past the end of a mapped file kills the process
with SIGBUS (exit 135 in a shell), so a regression fails the test instead of killing pytest."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

import pytest
from PIL import Image

from storage import FeatureWriter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO
    )


def xmodal(*args: str) -> subprocess.CompletedProcess:
    return run("-m", "pipelines.cli", *args)


def assert_clear_failure(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != -signal.SIGBUS, "killed by SIGBUS"
    assert proc.returncode in (1, 2), (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    for word in words:
        assert word in lines[-1], lines[-1]


@pytest.fixture
def store(tmp_path, make_record):
    """A 40-record store whose data file spans ~88 pages (values live on overflow pages)."""
    path = tmp_path / "s"
    with FeatureWriter(path, feature_dim=64) as w:
        for i in range(40):
            w.put(make_record(i))
    return path


def truncate(store, size: int) -> None:
    os.truncate(store / "data.mdb", size)


@pytest.mark.parametrize("keep", [0.1, "one page short"])
@pytest.mark.parametrize("command", ["verify", "info", "merge-src", "merge-dst"])
def test_truncated_store_is_refused_by_every_command(store, tmp_path, make_record, command, keep):
    size = (store / "data.mdb").stat().st_size
    truncate(store, int(size * keep) if isinstance(keep, float) else size - 4096)
    if command == "merge-src":
        proc = xmodal("features", "merge", str(store), str(tmp_path / "out"))
    elif command == "merge-dst":
        with FeatureWriter(tmp_path / "src", feature_dim=64) as w:
            w.put(make_record(99))
        proc = xmodal("features", "merge", str(tmp_path / "src"), str(store))
    else:
        proc = xmodal("features", command, str(store))
    if command == "verify":  # verify reports what it can still read, then the damage, and fails
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        problems = [line for line in proc.stdout.splitlines() if line.startswith("PROBLEM")]
        assert problems and "truncated" in problems[0] and str(store) in problems[0], proc.stdout
        assert "merge --salvage" in problems[0], problems[0]
        return
    assert_clear_failure(proc, "truncated", str(store), "merge --salvage")


@pytest.mark.parametrize(
    "code",
    [
        "r = FeatureReader(path); r['img_000039']",
        "r = FeatureReader(path, lock=True); 'img_000001' in r",
        "FeatureWriter(path, feature_dim=64)",
        "list(FeatureReader(path).keys())",
    ],
)
def test_truncated_store_raises_store_damaged_error_in_the_library(store, code):
    truncate(store, 40000)
    script = f"""
        import sys
        from storage import FeatureReader, FeatureWriter
        from storage.environment import StoreDamagedError
        path = {str(store)!r}
        try:
            {code}
        except StoreDamagedError as exc:
            print(exc)
            sys.exit(3)
    """
    proc = run("-c", textwrap.dedent(script))
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    assert "truncated" in proc.stdout and "40000 bytes" in proc.stdout


def test_empty_data_file(store, tmp_path):
    truncate(store, 0)
    for args in (["verify", str(store)], ["info", str(store)], ["merge", str(store), str(tmp_path / "o")]):
        assert_clear_failure(xmodal("features", *args), "empty (0 bytes)", str(store))


def test_a_data_file_that_is_not_lmdb(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "data.mdb").write_bytes(os.urandom(3 * 4096))
    assert_clear_failure(xmodal("features", "verify", str(tmp_path / "s")), "cannot be opened", "LMDB")


def test_an_intact_store_still_opens_after_the_checks(store):
    proc = xmodal("features", "verify", str(store))
    assert proc.returncode == 0 and "40 records checked, 0 bad" in proc.stdout


@pytest.mark.slow
def test_pretrain_on_a_truncated_store(store, tmp_path):
    truncate(store, 40000)
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\ncat\n")
    rows = [{"img_id": f"img_{i:06d}", "sentf": {"mscoco": ["a cat"]}, "labelf": {}} for i in range(40)]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    proc = xmodal(
        "pretrain",
        "--features",
        str(store),
        "--train",
        str(tmp_path / "train.json"),
        "--vocab",
        str(tmp_path / "vocab.txt"),
        "--out",
        str(tmp_path / "run"),
    )
    assert_clear_failure(proc, "truncated", str(store))


@pytest.mark.slow
def test_extract_into_a_truncated_store(store, tmp_path):
    truncate(store, 40000)
    (tmp_path / "images").mkdir()
    Image.new("RGB", (32, 24), (200, 10, 10)).save(tmp_path / "images" / "a.png")
    proc = xmodal("extract", str(tmp_path / "images"), "--out", str(store))
    assert_clear_failure(proc, "truncated", str(store))


def test_a_value_whose_pages_run_past_the_file_is_named_not_sigbus(store, tmp_path):
    """LMDB's meta agrees with the file, but one record's value pages run past its end: every reader names
    that record (lmdb would copy the value out of the map and die with SIGBUS), the others still read."""
    data = store / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.index(b"img_000039", 4096 * 2)  # the key in its leaf page; the value's first page follows
    raw[at + 10 : at + 18] = struct.pack("<Q", len(raw) // 4096 - 1)
    data.write_bytes(raw)
    script = f"""
        from storage import FeatureReader
        from storage.environment import StoreDamagedError
        from storage.merge import merge_stores
        from storage.verify import verify
        path = {str(store)!r}
        print(FeatureReader(path)["img_000010"].num_boxes)
        for code in ("FeatureReader(path)['img_000039']", "list(FeatureReader(path).items_encoded())",
                     "merge_stores([path], {str(tmp_path / "out")!r})"):
            try:
                eval(code)
            except StoreDamagedError as exc:
                print("refused:", exc)
        print(verify(path).problems[0])
    """
    proc = run("-c", textwrap.dedent(script))
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stdout.splitlines()
    assert lines[0] == "36" and len(lines) == 5, proc.stdout
    for line in lines[1:]:
        assert "the value of 'img_000039' cannot be read" in line and "outside the file" in line, line


def test_storage_imports_without_lmdb_and_opening_a_store_says_what_is_missing(tmp_path):
    """lmdb is imported where a store is opened: a machine without it imports storage and extraction
    (a GPU host running only the detector), and opening a store there is one line naming the package."""
    path = tmp_path / "s"
    with FeatureWriter(path, feature_dim=4):
        pass
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["lmdb"] = None  # `import lmdb` raises ImportError, as where it is not installed
        import storage, extraction
        from storage import FeatureReader, StoreError
        assert "lmdb" not in [name for name, module in sys.modules.items() if module is not None]
        try:
            FeatureReader({str(path)!r})["x"]
        except StoreError as exc:
            print(exc)
        """
    )
    proc = run("-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "needs the lmdb package" in proc.stdout and "pip install lmdb" in proc.stdout
