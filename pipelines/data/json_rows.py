"""Row files (a JSON list, or JSON lines) read with errors that name the file, the row and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path) -> Any:
    """One JSON document; unreadable or malformed files raise ValueError naming the file and the spot."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}; check the path") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); fix the file"
        ) from exc


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a JSON list file, or of a JSON-lines file (the official NLVR2 release)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}; check the path") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as first:
        data = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}: neither a JSON list ({first.msg} at line {first.lineno}) nor JSON lines "
                    f"(line {n}: {e.msg}); fix the file"
                ) from e
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected a JSON list of objects (or one object per line)")
    return data


def field(row: dict, name: str, kind: type | tuple[type, ...], path: Path, index: int):
    """`row[name]`, which must exist and be of `kind` (bools never pass for numbers)."""
    if name not in row:
        raise ValueError(f"{path}: row {index} has no {name!r} field (keys: {sorted(row)}); fix or remove it")
    value = row[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{path}: row {index} field {name!r} has type {type(value).__name__}; fix the row")
    return value
