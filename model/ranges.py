"""The ranges of typed settings, declared once per config class and checked in one place.

A config dataclass declares `RANGES: ClassVar[dict[str, str]]`, field name -> range, written as the
message shows it: `> 0`, `>= 0`, `[0, 1]`, `(0, 1]`, `[1, 1048576]`, or `device`. Plain strings, so a
package below this one declares ranges without importing it; `check_fields` reads them together with the
field types (every float must also be finite) and raises one-line ValueErrors naming the key, the value,
the allowed range and where the value came from."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any

_INTERVAL = re.compile(r"^([\[(])\s*(\S+?)\s*,\s*(\S+?)\s*([\])])$")
_BOUND = re.compile(r"^(>=|>|<=|<)\s*(\S+)$")
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def check_fields(obj: Any, where: str, prefix: str = "", names: typing.Iterable[str] | None = None) -> None:
    """Check dataclass `obj`'s fields (or only `names`) against their types and `RANGES`; nested dataclass
    fields are checked too. `prefix` is the key path shown (`train.`), `where` the source (a file, an
    argument)."""
    wanted = None if names is None else set(names)
    values = {
        f.name: getattr(obj, f.name)
        for f in dataclasses.fields(obj)
        if f.init and (wanted is None or f.name in wanted)
    }
    check_values(type(obj), values, where, prefix)


def check_values(cls: type, values: typing.Mapping[str, Any], where: str, prefix: str = "") -> None:
    """`check_fields` before construction: `values` (field name -> value) against `cls`'s types and
    `RANGES`, so that `__post_init__` only ever sees values of the right type and range."""
    hints = typing.get_type_hints(cls)
    ranges = getattr(cls, "RANGES", {})
    for name, value in values.items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_fields(value, where, f"{key}.")
            continue
        problem = type_problem(value, hints.get(name, Any))
        if problem is None and name in ranges:
            problem = range_problem(value, ranges[name])
        if problem is not None:
            raise ValueError(f"{where}: {key}={_show(value)} {problem}")


def type_problem(value: Any, tp: Any) -> str | None:
    """None when `value` has type `tp`, else what is wrong ("must be an integer")."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or isinstance(tp, typing.TypeVar):
        return None
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        problems = [type_problem(value, a) for a in args if a is not type(None)]
        if any(p is None for p in problems):
            return None
        return problems[0] if len(problems) == 1 else f"does not fit {_type_name(tp)}"
    if origin is typing.Literal:
        return None if value in args else f"must be one of {list(args)}"
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return "must be a list"
        if origin is tuple and args and args[-1] is not Ellipsis and len(value) != len(args):
            return f"must be a list of {len(args)} values"
        inner = (
            args
            if origin is tuple and args and args[-1] is not Ellipsis
            else (args[:1] or (Any,)) * len(value)
        )
        for item, item_tp in zip(value, inner, strict=True):
            problem = type_problem(item, item_tp)
            if problem is not None:
                return f"has an item {_show(item)} that {problem}"
        return None
    if origin is dict:
        return None if isinstance(value, dict) else "must be a mapping"
    if tp is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        return None if math.isfinite(value) else "must be a finite number"
    if tp is str:
        return None if isinstance(value, str) else "must be a string"
    return None


def range_problem(value: Any, spec: str) -> str | None:
    """None when `value` (None passes: "not set") is inside `spec`, else "must be <spec>"."""
    if value is None:
        return None
    if spec == "device":
        return _device_problem(str(value))
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        if not _inside(v, spec):
            return f"is out of range: must be {spec}"
    return None


def _inside(v: float, spec: str) -> bool:
    interval = _INTERVAL.match(spec)
    if interval:
        left, low, high, right = interval.groups()
        low_ok = v >= float(low) if left == "[" else v > float(low)
        high_ok = v <= float(high) if right == "]" else v < float(high)
        return low_ok and high_ok
    bound = _BOUND.match(spec)
    if bound is None:
        raise ValueError(f"range {spec!r} is not of the forms '> 0', '[0, 1]', 'device'")
    op, limit = bound.groups()
    return {">=": v >= float(limit), ">": v > float(limit), "<=": v <= float(limit), "<": v < float(limit)}[
        op
    ]


def _device_problem(name: str) -> str | None:
    if not _DEVICE.match(name):
        return "is not a device: use auto, cpu, mps, cuda or cuda:N"
    if name.startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
        index = int(name.partition(":")[2] or 0)
        if index >= count:
            have = f"cuda:0..cuda:{count - 1}" if count else "no CUDA device"
            return f"is not on this machine (it has {have}); use auto or cpu"
    if name == "mps":
        import torch

        if not torch.backends.mps.is_available():
            return "is not on this machine (no MPS device); use auto or cpu"
    return None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."
