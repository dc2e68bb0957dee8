"""The store's own small files (a shard set's manifest) and JSON records (metadata) read safely: a regular
file of a plausible size only (a FIFO would hang the reader, a device never end) and JSON whose nesting
the parser can follow (deeper is refused, not a crash). Errors are one line: the file and the fix."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from storage.errors import StoreFormatError

MANIFEST_LIMIT = 16 << 20  # a manifest lists a few hundred shards and their provenance: kilobytes


def regular_file(path: Path, limit: int, fix: str) -> Path:
    """`path` if it is a regular file (links followed) of at most `limit` bytes; `fix` says what to do."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise StoreFormatError(f"{path} is missing: {fix}") from None
    except OSError as exc:
        raise StoreFormatError(f"{path} cannot be read ({exc.strerror}): {fix}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = (
            "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, socket or device)"
        )
        raise StoreFormatError(f"{path} is {kind}: {fix}")
    if info.st_size > limit:
        raise StoreFormatError(
            f"{path} is {info.st_size} bytes, more than such a file can be ({limit}): {fix}"
        )
    return path


def read_json_file(path: Path, limit: int, fix: str) -> Any:
    """The JSON document in the regular file `path` (see `regular_file`), nesting limited."""
    regular_file(path, limit, fix)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(limit + 1)
    except OSError as exc:
        raise StoreFormatError(f"{path} cannot be read ({exc.strerror}): {fix}") from None
    if len(raw) > limit:
        raise StoreFormatError(f"{path} grew past {limit} bytes while read: {fix}")
    return parse_json(raw, str(path), fix)


def parse_json(raw: bytes, where: str, fix: str) -> Any:
    """JSON from `raw` (UTF-8), refused when invalid or nested deeper than the parser can follow."""
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreFormatError(f"{where} is not valid JSON ({exc}): {fix}") from None
    except RecursionError:
        raise StoreFormatError(f"{where} is JSON nested too deeply to read: {fix}") from None
