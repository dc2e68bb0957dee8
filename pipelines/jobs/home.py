"""The home folder that Ray (its auth token, ~/.ray/auth_token) and the caches under ~ write to: the
user's own, or else a private one, never a folder other users can write or read."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger(__name__)


def private_home(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Point HOME at `$TMPDIR/xmodal-home-<uid>` (mode 0700) when it is not a folder this user owns and
    can write, and return it; None when HOME is fine.

    A container run as an arbitrary uid (compose's XMODAL_UID) inherits the image's HOME, which belongs
    to the image's user: sharing it writable with every uid would hand each user's Ray token to the
    others. The private folder is refused (PermissionError naming it) if another user made it first.
    """
    uid = os.getuid()
    home = environ.get("HOME")
    if home and _owned_and_writable(Path(home), uid):
        return None
    private = Path(tempfile.gettempdir()) / f"xmodal-home-{uid}"
    with contextlib.suppress(FileExistsError):  # made by an earlier run: checked below
        private.mkdir(mode=0o700)
    info = private.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise PermissionError(
            f"{private} is not a private folder of uid {uid} (owner uid {info.st_uid}, mode "
            f"{stat.filemode(info.st_mode)}); remove it, or set HOME to a folder you own"
        )
    environ["HOME"] = str(private)
    log.debug("HOME %s is not this user's: using %s", home, private)
    return private


def _owned_and_writable(path: Path, uid: int) -> bool:
    try:
        info = path.stat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid and os.access(path, os.W_OK | os.X_OK)
