"""Typed dataclass configs: build from dicts and YAML, override with `key=value` (nested `a.b=c`), save."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "config") -> T:
    """Build dataclass `cls` from a (nested) mapping; unknown keys and wrong types raise ValueError."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} for {cls.__name__}; known: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as plain YAML/JSON-friendly data (paths as strings, tuples as lists)."""
    return _plain(dataclasses.asdict(obj))


def load(
    cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = (), base: T | None = None
) -> T:
    """`base` (or `cls()`), then the YAML file's keys, then `key=value` overrides, in that order."""
    cfg = base if base is not None else cls()
    if path is not None:
        data = load_yaml(path)
        cfg = merge(cfg, data, where=str(path))
    return apply_overrides(cfg, overrides)


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML ({exc})") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of config keys")
    return data


def save_yaml(obj: Any, path: str | Path) -> None:
    data = to_dict(obj) if dataclasses.is_dataclass(obj) else _plain(obj)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def merge(cfg: T, data: Mapping[str, Any], where: str = "config") -> T:
    """A copy of dataclass `cfg` with the keys of `data` replaced; nested dataclasses and mappings merge."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping for {type(cfg).__name__}")
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg) if f.init}
    changes = {}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"{where}: unknown key {key!r} for {type(cfg).__name__}; known: {sorted(names)}")
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            changes[key] = merge(current, value, f"{where}.{key}")
        elif isinstance(current, dict) and isinstance(value, Mapping):
            # a free-form mapping (model or detector overrides): `a.b=c` sets one key, keeps the others
            changes[key] = _coerce(_deep_update(current, value), hints[key], f"{where}.{key}")
        else:
            changes[key] = _coerce(value, hints[key], f"{where}.{key}")
    return dataclasses.replace(cfg, **changes)


def apply_overrides(cfg: T, overrides: Sequence[str]) -> T:
    """Apply `key=value` strings (values parsed as YAML scalars, nested keys with dots: `train.lr=3e-5`)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value (nested keys: a.b=value)")
        value: Any = yaml.safe_load(text) if text.strip() else None
        for part in reversed(key.split(".")[1:]):
            value = {part: value}
        cfg = merge(cfg, {key.split(".")[0]: value}, where=f"override {item!r}")
    return cfg


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError(errors[0] if len(errors) == 1 else f"{where}: {value!r} does not fit {tp}")
    if origin is typing.Literal:
        if value not in args:
            raise ValueError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin in (list, tuple, Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value):
            return value
        return from_dict(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{where}: expected a string, got {value!r}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ValueError(f"{where}: expected a path, got {value!r}")
    return value


def _deep_update(base: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in new.items():
        out[k] = _deep_update(out[k], v) if isinstance(out.get(k), Mapping) and isinstance(v, Mapping) else v
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
