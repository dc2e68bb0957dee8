"""Typed dataclass configs: build from dicts and YAML, override with `key=value` (nested `a.b=c`), save."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from model.files import MAX_DEPTH, TEXT_LIMIT, nesting_depth, read_text
from model.ranges import check_fields, check_values

T = TypeVar("T")


class SettingError(ValueError):
    """A setting that does not fit: one line naming the source, the key, the value and the allowed range."""

    def __init__(self, source: str, key: str, message: str):
        super().__init__(f"{source}: {message}")
        self.source, self.key, self.message = source, key, message


def from_dict(cls: type[T], data: Mapping[str, Any], where: str = "config", prefix: str = "") -> T:
    """Build dataclass `cls` from a (nested) mapping; unknown keys, wrong types and values out of the
    class's `RANGES` raise SettingError naming `where` (the source) and the key."""
    if not isinstance(data, Mapping):
        raise SettingError(
            where, prefix, f"{prefix or cls.__name__} must be a mapping of keys for {cls.__name__}"
        )
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SettingError(
            where,
            f"{prefix}{unknown[0]}",
            f"unknown key(s) {[prefix + k for k in unknown]}; known: {sorted(names)}",
        )
    kwargs = {k: _coerce(v, hints[k], where, f"{prefix}{k}") for k, v in data.items()}
    _check(cls, kwargs, where, prefix)
    return _construct(lambda: cls(**kwargs), where, prefix)


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as plain YAML/JSON-friendly data (paths as strings, tuples as lists)."""
    return _plain(dataclasses.asdict(obj))


def load(
    cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = (), base: T | None = None
) -> T:
    """`base` (or `cls()`), then the YAML file's keys, then `key=value` overrides, in that order."""
    cfg = base if base is not None else cls()
    if path is not None:
        text = read_text(path, "config", TEXT_LIMIT)
        data = _top_mapping(parse_yaml(text, str(path)), path)
        try:
            cfg = merge(cfg, data, where=str(path))
        except SettingError as exc:
            line = _key_lines(text).get(exc.key)
            if line is None:
                raise
            raise SettingError(f"{path}, line {line}", exc.key, exc.message) from None
    return apply_overrides(cfg, overrides)


def load_yaml(path: str | Path) -> dict[str, Any]:
    return _top_mapping(parse_yaml(read_text(path, "config", TEXT_LIMIT), str(path)), path)


def _top_mapping(data: Any, path: str | Path) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of config keys")
    return data


class _PlainLoader(yaml.SafeLoader):
    """Safe YAML without aliases: `*name` can make a few bytes stand for billions of values."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None,
                None,
                "aliases (*name) are not read in settings; write the value out",
                self.peek_event().start_mark,
            )
        return super().compose_node(parent, index)


def parse_yaml(text: str, where: str) -> Any:
    """Plain YAML data (mappings, lists, scalars) nested at most MAX_DEPTH deep; any other tag, e.g.
    !!python/object, and aliases are refused: ValueError on one line naming `where`, the line and the
    problem."""
    try:
        data = yaml.load(text, Loader=_PlainLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise ValueError(f"{where}: refused YAML (nested too deeply; at most {MAX_DEPTH} levels)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if isinstance(exc, yaml.constructor.ConstructorError):
            problem = (
                f"{problem}: only plain values (numbers, strings, lists, mappings) are read, never objects"
            )
        raise ValueError(f"{where}: refused YAML{at} ({problem})") from None
    if nesting_depth(data) > MAX_DEPTH:
        raise ValueError(f"{where}: refused YAML (nested more than {MAX_DEPTH} levels deep)")
    return data


def _key_lines(text: str) -> dict[str, int]:
    """Dotted key -> the line (1-based) it is written on, for messages about a file's values."""
    lines: dict[str, int] = {}
    try:
        root = yaml.compose(text, Loader=_PlainLoader)  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, RecursionError):
        return lines
    stack = [(root, "")]
    while stack:
        node, prefix = stack.pop()
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = f"{prefix}{key.value}"
                lines[name] = key.start_mark.line + 1
                stack.append((value, f"{name}."))
    return lines


def save_yaml(obj: Any, path: str | Path) -> None:
    data = to_dict(obj) if dataclasses.is_dataclass(obj) else _plain(obj)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def merge(cfg: T, data: Mapping[str, Any], where: str = "config", prefix: str = "") -> T:
    """A copy of dataclass `cfg` with the keys of `data` replaced; nested dataclasses and mappings merge.
    Each changed value is checked against its type and the class's `RANGES` (SettingError)."""
    if not isinstance(data, Mapping):
        raise SettingError(
            where, prefix, f"{prefix or 'the config'} must be a mapping of keys for {type(cfg).__name__}"
        )
    hints = typing.get_type_hints(type(cfg))
    names = {f.name for f in dataclasses.fields(cfg) if f.init}
    changes = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in names:
            raise SettingError(
                where, name, f"unknown key {name!r} for {type(cfg).__name__}; known: {sorted(names)}"
            )
        current = getattr(cfg, key)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            changes[key] = merge(current, value, where, f"{name}.")
        elif isinstance(current, dict) and isinstance(value, Mapping):
            # a free-form mapping (model or detector overrides): `a.b=c` sets one key, keeps the others
            changes[key] = _coerce(_deep_update(current, value), hints[key], where, name)
        else:
            changes[key] = _coerce(value, hints[key], where, name)
    _check(type(cfg), changes, where, prefix)
    return _construct(lambda: dataclasses.replace(cfg, **changes), where, prefix)


def apply_overrides(cfg: T, overrides: Sequence[str]) -> T:
    """Apply `key=value` strings (values parsed as YAML scalars, nested keys with dots: `train.lr=3e-5`)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key=value (nested keys: a.b=value)")
        value: Any = parse_yaml(text, f"override {item!r}") if text.strip() else None
        for part in reversed(key.split(".")[1:]):
            value = {part: value}
        cfg = merge(cfg, {key.split(".")[0]: value}, where=f"override {item!r}")
    return cfg


def check(cfg: Any, where: str = "config") -> None:
    """Every field of dataclass `cfg`, nested ones too, against its type and range."""
    try:
        check_fields(cfg, where)
    except ValueError as exc:
        raise SettingError(where, "", str(exc).removeprefix(f"{where}: ")) from None


def check_settings(classes: Sequence[type], values: Mapping[str, Any], where: str, prefix: str = "") -> None:
    """A free-form mapping of settings (`--set` detector overrides, `task.model`): each key must be a field
    of one of `classes`, of its type and inside its range (SettingError otherwise)."""
    if not isinstance(values, Mapping):
        raise SettingError(where, prefix, f"{prefix.rstrip('.') or 'settings'} must be a mapping of keys")
    for key, value in values.items():
        owner = next((c for c in classes if key in {f.name for f in dataclasses.fields(c)}), None)
        if owner is None:
            known = sorted({f.name for c in classes for f in dataclasses.fields(c)})
            raise SettingError(where, f"{prefix}{key}", f"unknown setting {prefix}{key!r}; known: {known}")
        hint = typing.get_type_hints(owner)[key]
        _check(owner, {key: _coerce(value, hint, where, f"{prefix}{key}")}, where, prefix)


def check_mapping_field(classes: Sequence[type], values: Mapping[str, Any], key: str) -> None:
    """`check_settings` for a config's free-form mapping field `key` (`task.model`), from the config's
    `__post_init__`: a plain one-line ValueError, so that the merge building the config puts the source
    (file and line, or the KEY=VALUE argument) in front."""
    try:
        check_settings(classes, values, key, f"{key}.")
    except SettingError as exc:
        raise ValueError(exc.message) from None


def _check(cls: type, values: Mapping[str, Any], where: str, prefix: str) -> None:
    plain = {k: v for k, v in values.items() if not dataclasses.is_dataclass(v)}
    try:
        check_values(cls, plain, where, prefix)
    except ValueError as exc:
        key = str(exc).removeprefix(f"{where}: ").partition("=")[0]
        raise SettingError(where, key, str(exc).removeprefix(f"{where}: ")) from None


def _construct(build: typing.Callable[[], T], where: str, prefix: str) -> T:
    """A dataclass's own cross-field checks (`__post_init__`), with the source in front."""
    try:
        return build()
    except SettingError:
        raise
    except (ValueError, TypeError) as exc:
        raise SettingError(where, prefix.rstrip("."), str(exc)) from None


def _coerce(value: Any, tp: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)

    def bad(problem: str) -> SettingError:
        shown = repr(value) if len(repr(value)) <= 60 else f"{repr(value)[:57]}..."
        return SettingError(where, key, f"{key}={shown} {problem}")

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
                return _coerce(value, arg, where, key)
            except SettingError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise bad(f"does not fit {str(tp).replace('typing.', '')}")
    if origin is typing.Literal:
        # YAML reads on/off (and yes/no, true/false) as booleans: they name the choices 'on' and 'off'
        if isinstance(value, bool) and ("on" if value else "off") in args:
            return "on" if value else "off"
        if value not in args:
            raise bad(f"is not one of {list(args)}")
        return value
    if origin in (list, tuple, Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise bad("must be a list")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, where, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise bad("must be a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value):
            return value
        return from_dict(tp, value, where, f"{key}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad("must be true/false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad("must be an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise bad("must be a number")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad("must be a string")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise bad("must be a path")
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
