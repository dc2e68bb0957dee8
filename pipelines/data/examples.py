"""What every fine-tuning example offers (its key, its images, its label), and the store check over them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pipelines.data.columns import RowColumns


class Example(Protocol):
    """A labelled or unlabelled example of a fine-tuning split."""

    label: Any

    @property
    def key(self) -> int | str: ...

    @property
    def images(self) -> tuple[str, ...]: ...


def image_ids(examples: Sequence[Example]) -> list[str]:
    """Every image id the examples (or `RowColumns`) refer to, in first-use order."""
    if isinstance(examples, RowColumns):
        return examples.used_images()
    ids: dict[str, None] = {}
    for ex in examples:
        for img in ex.images:
            ids.setdefault(img, None)
    return list(ids)


def unlabelled_keys(examples: Sequence[Example]) -> list:
    """The keys of the examples (or `RowColumns`) without a label."""
    if isinstance(examples, RowColumns):
        return examples.unlabelled_keys()
    return [e.key for e in examples if e.label is None]


def check_images(examples: Sequence[Example], features, what: str, skippable: bool = False) -> None:
    """Fail with a count and examples when images are missing from the feature store (`skippable`: the
    command has --skip-missing)."""
    missing = [img for img in image_ids(examples) if img not in features]
    if missing:
        fixes = "extract them or pass the store that holds them"
        if skippable:
            fixes = "extract them, pass the store that holds them, or drop those examples with --skip-missing"
        raise ValueError(
            f"{what}: {len(missing)} image ids are not in the feature store (e.g. {missing[:5]}); {fixes}"
        )
