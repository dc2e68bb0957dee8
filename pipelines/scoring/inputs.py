"""Reading gold and prediction files: JSON loading and the error that names the file and the row."""

from __future__ import annotations

import os
from pathlib import Path

from model.files import read_json


class ScoringInputError(ValueError):
    """A gold or prediction file is missing, unreadable or malformed; names the file and the row."""


def load_json(path: str | os.PathLike) -> object:
    """The parsed JSON of `path`, or a one-line error saying where it is broken."""
    path = Path(path)
    try:
        return read_json(path, "JSON file")
    except FileNotFoundError:
        raise ScoringInputError(f"{path}: no such file") from None
    except ValueError as exc:
        raise ScoringInputError(str(exc)) from None


def rows_of(data: object, path: str | os.PathLike, what: str) -> list[dict]:
    """`data` as a list of JSON objects, or an error naming the first row that is not one."""
    if not isinstance(data, list):
        raise ScoringInputError(f"{path}: expected a JSON list of {what}, got {type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ScoringInputError(f"{path} row {i}: expected a JSON object, got {type(row).__name__}")
    return data


def required(row: dict, key: str, kind: type | tuple[type, ...], where: str) -> object:
    """`row[key]`, checked to be of `kind` (bool never passes for int)."""
    if key not in row:
        raise ScoringInputError(f"{where}: no {key!r} field")
    value = row[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ScoringInputError(f"{where}: {key!r} is {value!r}, not {_names(kind)}")
    if not isinstance(value, kind):
        raise ScoringInputError(f"{where}: {key!r} is {value!r}, not {_names(kind)}")
    return value


def _names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(
        {int: "an integer", str: "a string", dict: "an object", list: "a list"}.get(k, k.__name__)
        for k in kinds
    )


def missing_error(what: str, missing: list, gold: str | os.PathLike | None = None) -> ScoringInputError:
    """The error for gold items without a prediction: how many, and the first few."""
    shown = ", ".join(repr(m) for m in missing[:5])
    source = f" of {gold}" if gold is not None else ""
    return ScoringInputError(
        f"{len(missing)} {what}{source} have no prediction (e.g. {shown}): predict every one before scoring"
    )
