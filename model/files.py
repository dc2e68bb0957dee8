"""Opening files a user names: regular files of a plausible size only (never a FIFO, a device or a
directory, which hang or never end), and JSON parsed with a nesting limit. Errors are one-line
ValueErrors naming the file and what to do."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

# config, vocabulary, index and row files far above these are not what the reader expects
TEXT_LIMIT = 64 << 20
JSON_LIMIT = 4 << 30
MAX_DEPTH = 64


def regular_file(path: str | Path, what: str = "file", limit: int | None = None) -> Path:
    """`path` when it is a regular file (links followed) no larger than `limit` bytes; FileNotFoundError
    when it does not exist, ValueError for anything else."""
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {str(path)!r} not found; check the path") from None
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be read ({exc.strerror}); check the path") from None
    if not stat.S_ISREG(info.st_mode):
        kind = (
            "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, socket or device)"
        )
        raise ValueError(f"{what} {str(path)!r} is {kind}; give a regular file")
    if limit is not None and info.st_size > limit:
        raise ValueError(
            f"{what} {str(path)!r} is {info.st_size} bytes, more than the {limit} such a file can be; "
            "check the path"
        )
    return path


def read_text(path: str | Path, what: str = "file", limit: int = TEXT_LIMIT) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes."""
    path = regular_file(path, what, limit)
    try:
        with open(path, "rb") as fh:
            # what the file holds, +1 to see it grow: a read of `limit` bytes would reserve that much
            size = min(os.fstat(fh.fileno()).st_size, limit)
            data = fh.read(size + 1)
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be read ({exc.strerror}); check the path") from None
    if len(data) > size:
        raise ValueError(f"{what} {str(path)!r} grew while read (past {size} bytes); check the path")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{what} {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


def parse_json(text: str, where: str) -> Any:
    """JSON data; a document nested deeper than the parser's recursion limit is one error, not a crash."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{where}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); fix the file"
        ) from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to read; fix the file") from None


def nesting_depth(data: Any, limit: int = MAX_DEPTH) -> int:
    """How deep lists and mappings nest in parsed `data`, counted without recursion up to `limit` + 1."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, tuple, dict)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def read_json(path: str | Path, what: str = "JSON file", limit: int = JSON_LIMIT) -> Any:
    """One JSON document from a regular file, nesting and size limited."""
    return parse_json(read_text(path, what, limit), f"{what} {str(Path(path))!r}")
