"""What every family config shares: named presets, and dicts read field by field."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="PresetConfig")


class PresetConfig:
    """Mixed into a family's config dataclass, which sets `PRESETS` (name -> field values) and `FAMILY`
    (how messages name it)."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]]
    FAMILY: ClassVar[str]

    @classmethod
    def preset(cls: type[C], name: str, **overrides: Any) -> C:
        """A named configuration with any field overridden."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown {cls.FAMILY} preset {name!r}; choose one of {sorted(cls.PRESETS)}")
        return cls.from_dict({**cls.PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        """Build from a dict, rejecting unknown keys by name (a typo must not pass silently)."""
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]
