"""The one rule by which a row's image (`sub/a.jpg`, `a.jpg`, `a`) names a stored record, for every task.

A reference is looked up, first match wins:
1. as given (the id `extract` stored: a stem, or with `--id-from relpath` the path with its suffix);
2. with its picture suffix dropped, or with one added (`sub/a.jpg` finds `sub/a`, `sub/a` finds `sub/a.jpg`);
3. by file stem, when exactly one stored id has that stem (`a.jpg` finds `sub/a.jpg`; `val2014/x.jpg` finds
   `x` in a store keyed by stems).
Two matches at the same step are ambiguous and refused rather than guessed."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import PurePosixPath

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif", ".ppm", ".pgm"}
)
MAX_CANDIDATES = 8  # stored images named when a reference could be any of them


class AmbiguousImage(ValueError):
    """A reference matches more than one stored id at the same step of the rule."""


def file_stem(ref: str) -> str:
    """The name without folders and without a picture suffix."""
    name = PurePosixPath(ref.replace("\\", "/")).name
    return _drop_suffix(name)


def _drop_suffix(ref: str) -> str:
    suffix = PurePosixPath(ref).suffix
    return ref[: -len(suffix)] if suffix and suffix.lower() in IMAGE_SUFFIXES else ref


def image_ref(value: object) -> str | None:
    """A row's image field as a reference: a string, a number (COCO ids), or a HF `datasets` Image's
    {"path": ...}; None when it is none of these."""
    if isinstance(value, dict) and isinstance(value.get("path"), str):
        value = value["path"]
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


class ImageIds:
    """Resolves references against a set of ids given by a membership test and (for step 3) a listing."""

    def __init__(self, contains: Callable[[str], bool], listing: Callable[[], Iterable[str]]) -> None:
        self._contains = contains
        self._listing = listing
        self._by_stem: dict[str, list[str]] | None = None
        self._cache: dict[str, str | None] = {}

    @classmethod
    def of(cls, ids: Iterable[str]) -> ImageIds:
        known = set(ids)
        return cls(known.__contains__, lambda: known)

    def resolve(self, ref: str) -> str | None:
        """The stored id `ref` names, None when none; AmbiguousImage when several."""
        if ref not in self._cache:
            self._cache[ref] = self._resolve(ref)
        return self._cache[ref]

    def _resolve(self, ref: str) -> str | None:
        if self._contains(ref):
            return ref
        base = _drop_suffix(ref)
        near = [base] if base != ref else [ref + s for s in sorted(IMAGE_SUFFIXES)]
        near += [ref + s.upper() for s in sorted(IMAGE_SUFFIXES)] if base == ref else []
        found = [c for c in near if self._contains(c)]
        if len(found) > 1:
            raise AmbiguousImage(f"image {ref!r} could be any of {found}; name it with its suffix")
        if found:
            return found[0]
        match = self._stems().get(file_stem(ref), [])
        if len(match) > 1:
            listed = ", ".join(repr(m) for m in sorted(match)[:MAX_CANDIDATES])
            more = f" and {len(match) - MAX_CANDIDATES} more" if len(match) > MAX_CANDIDATES else ""
            raise AmbiguousImage(
                f"image {ref!r}: several stored images are called {file_stem(ref)!r} ({listed}{more}); "
                "name it by its path"
            )
        return match[0] if match else None

    def _stems(self) -> dict[str, list[str]]:
        if self._by_stem is None:
            self._by_stem = {}
            for img_id in self._listing():
                self._by_stem.setdefault(file_stem(img_id), []).append(img_id)
        return self._by_stem


class StoreImages:
    """A feature reader looked up through the rule: `ref in store`, `store[ref]`; the rest is the reader's.

    Pickles with its reader, so DataLoader workers reopen the store as the reader does."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self.ids = ImageIds(reader.__contains__, reader.keys)

    def resolve(self, ref: str) -> str | None:
        return self.ids.resolve(ref)

    def __contains__(self, ref: object) -> bool:
        return isinstance(ref, str) and self.ids.resolve(ref) is not None

    def __getitem__(self, ref: str):
        img_id = self.ids.resolve(ref)
        if img_id is None:
            raise KeyError(ref)
        return self.reader[img_id]

    def read_batch(self, refs: list[str], *args, **kwargs):
        """The reader's one-transaction batch read, each reference resolved by the rule first."""
        ids = []
        for ref in refs:
            img_id = self.ids.resolve(ref)
            if img_id is None:
                raise KeyError(ref)
            ids.append(img_id)
        return self.reader.read_batch(ids, *args, **kwargs)

    def get(self, ref: str, default=None):
        img_id = self.ids.resolve(ref)
        return default if img_id is None else self.reader.get(img_id, default)

    def __len__(self) -> int:
        return len(self.reader)

    def __getattr__(self, name: str):
        if name == "reader":  # not yet set (while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.reader, name)
