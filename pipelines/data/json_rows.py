"""Row files (a JSON list, or JSON lines) read with errors that name the file, the row and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model.files import JSON_LIMIT, parse_json, read_text


def read_json(path: str | Path) -> Any:
    """One JSON document; unreadable, non-regular, too deep or malformed files raise ValueError naming the
    file and the spot."""
    return _parse(Path(path), _read(path))


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a JSON list file, or of a JSON-lines file (the official NLVR2 release)."""
    path = Path(path)
    text = _read(path)
    try:
        data = _parse(path, text)
    except ValueError as first:
        data = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                data.append(parse_json(line, f"{path} line {n}"))
            except ValueError as e:
                raise ValueError(f"{path}: neither a JSON list ({first}) nor JSON lines ({e})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected a JSON list of objects (or one object per line)")
    return data


def _read(path: str | Path) -> str:
    try:
        return read_text(path, "JSON file", JSON_LIMIT)
    except FileNotFoundError as exc:
        raise ValueError(f"{exc}") from None


def _parse(path: Path, text: str) -> Any:
    return parse_json(text, str(path))


def field(row: dict, name: str, kind: type | tuple[type, ...], path: Path, index: int):
    """`row[name]`, which must exist and be of `kind` (bools never pass for numbers)."""
    if name not in row:
        raise ValueError(f"{path}: row {index} has no {name!r} field (keys: {sorted(row)}); fix or remove it")
    value = row[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{path}: row {index} field {name!r} has type {type(value).__name__}; fix the row")
    return value
