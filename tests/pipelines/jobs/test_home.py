"""HOME for Ray's token and the caches: the user's own, else a private folder, as in a container run as
any uid. The uid cases run in forked children under other uids (the tests need root for that)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from pipelines.jobs.home import private_home

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root")


def _as_uid(uid: int, home: str, tmp) -> tuple[int, str]:
    """(exit status, HOME or the refusal) of `private_home()` in a forked child running as `uid` with
    HOME=`home` and TMPDIR=`tmp`, as `xmodal` would run in a container started with that uid."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            os.close(read)
            os.setgid(uid)
            os.setuid(uid)
            tempfile.tempdir = str(tmp)
            env = {"HOME": home}
            try:
                private_home(env)
                message, status = env["HOME"], 0
            except PermissionError as exc:
                message = str(exc)
            os.write(write, message.encode())
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as f:
        message = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), message


@pytest.fixture
def open_tmp():
    """A folder other uids can reach (pytest's tmp_path lies under a root-only folder), removed after."""
    root = tempfile.mkdtemp(prefix="xmodal-home-test-", dir="/tmp")
    os.chmod(root, 0o755)
    yield Path(root)
    shutil.rmtree(root)


def test_an_own_home_is_kept(tmp_path):
    env = {"HOME": str(tmp_path)}
    assert private_home(env) is None and env["HOME"] == str(tmp_path)


@needs_root
def test_another_uid_gets_a_private_home_the_image_user_cannot_see(open_tmp):
    image_home = open_tmp / "home"
    image_home.mkdir(mode=0o700)  # the image's home: its user's only (root here)
    tmp = open_tmp / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    private = tmp / "xmodal-home-4321"
    assert _as_uid(4321, str(image_home), tmp) == (0, str(private))
    info = private.stat()
    assert info.st_uid == 4321 and info.st_mode & 0o777 == 0o700
    assert _as_uid(4321, str(image_home), tmp) == (0, str(private))  # a second run reuses it
    # a home that every uid may write (the old image's 1777) is not trusted either
    os.chmod(image_home, 0o1777)
    assert _as_uid(4321, str(image_home), tmp) == (0, str(private))


@needs_root
def test_a_private_folder_planted_by_another_user_is_refused(open_tmp):
    tmp = open_tmp / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    (tmp / "xmodal-home-4321").mkdir()
    os.chown(tmp / "xmodal-home-4321", 5555, 5555)  # made by uid 5555, waiting for 4321's token
    status, message = _as_uid(4321, "/nonexistent", tmp)
    assert status == 1 and "is not a private folder of uid 4321 (owner uid 5555" in message
