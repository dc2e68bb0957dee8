"""The images a job reads: folders, list files and single files, each with its record id.

A file name that is not UTF-8 (bytes from another locale) gets a readable, stable id: its bytes decoded as
UTF-8 with each undecodable byte written as `\\xNN` (`caf\\xe9` for b"caf\\xe9"); the file itself is read
under its real name."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipelines.data.image_refs import IMAGE_SUFFIXES
from storage.codec import MAX_ID_BYTES

log = logging.getLogger(__name__)

LIST_SUFFIXES = frozenset({".txt", ".lst", ".list"})
ID_RULES = ("stem", "relpath")


class InputError(ValueError):
    """The input set is unusable as given (missing path, duplicate ids, nothing to do)."""


@dataclass(frozen=True)
class ImageInput:
    img_id: str
    path: str


def iter_images(
    sources: Iterable[str | Path], recursive: bool = False, id_from: str = "stem"
) -> Iterator[ImageInput]:
    """Yield the images of every source in a stable order, without holding the listing.

    A folder gives its image files (by suffix, hidden files skipped; with `recursive` its sub-folders by
    name, then the symlinked ones, each folder listed once: a link to a folder already listed, a loop
    for one, is skipped with a warning); a .txt/.lst/.list file gives one path per line (relative to the
    list's folder; blank lines and `#` comments skipped); any other file is one image. Ids are file
    stems, or with `id_from="relpath"` the path relative to the folder or list it came from (POSIX
    separators, suffix kept); non-UTF-8 names are escaped (see the module docstring). What the files hold
    is not looked at here: a FIFO or a device named like an image is refused when it is read
    (`extraction.load_image`).
    """
    if id_from not in ID_RULES:
        raise ValueError(f"id_from must be one of {ID_RULES}, got {id_from!r}")
    for source in sources:
        root = Path(source)
        if root.is_dir():
            for path in _walk(root, recursive):
                yield ImageInput(_make_id(path, root, id_from), str(path))
        elif root.suffix.lower() in LIST_SUFFIXES and root.is_file():
            yield from _read_list(root, id_from)
        elif root.exists() or root.is_symlink():
            _check_named_image(root)
            yield ImageInput(_make_id(root, root.parent, id_from), str(root))
        else:
            raise InputError(
                f"input {str(source)!r} does not exist: give image folders, list files or images"
            )


def _check_named_image(path: Path) -> None:
    """A file named as an input must be an image (header only): a wrong file stops the job before it starts,
    while bad files inside folders and lists are logged and skipped by the job."""
    from PIL import Image, UnidentifiedImageError

    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise InputError(
            f"input {str(path)!r} is not an image ({', '.join(sorted(IMAGE_SUFFIXES))}), a list file "
            f"({', '.join(sorted(LIST_SUFFIXES))}) or a folder"
        )
    if not path.is_file():
        raise InputError(f"input {str(path)!r} is not a regular file")
    try:
        with Image.open(path):
            pass
    except (UnidentifiedImageError, OSError) as exc:
        raise InputError(f"input {str(path)!r} is not a readable image ({exc})") from exc


def unique_ids(sources: Sequence[str | Path], recursive: bool = False, id_from: str = "stem") -> set[str]:
    """The ids of all images; InputError naming the files if ids clash or overflow a key, or none is found.

    Memory grows with the number of names (not images): the price of refusing duplicates before any work.
    """
    seen: set[str] = set()
    clashes: list[str] = []
    too_long: ImageInput | None = None  # the first of `n_long`
    n_long = 0
    for item in iter_images(sources, recursive, id_from):
        if item.img_id in seen:
            clashes.append(item.img_id)
        seen.add(item.img_id)
        if len(item.img_id.encode("utf-8")) > MAX_ID_BYTES:
            too_long = too_long or item
            n_long += 1
    if too_long is not None:
        size = len(too_long.img_id.encode("utf-8"))
        more = f" (and {n_long - 1} more)" if n_long > 1 else ""
        hint = "; use --id-from stem" if id_from == "relpath" else ""
        raise InputError(
            f"image {too_long.path!r}{more}: its id is {size} bytes long, more "
            f"than the {MAX_ID_BYTES} bytes a feature store key holds; shorten the file names{hint}"
        )
    if not seen:
        hint = "" if recursive else "; add --recursive to descend into sub-folders"
        raise InputError(
            f"no images found in {[str(s) for s in sources]} (by suffix: {sorted(IMAGE_SUFFIXES)}){hint}"
        )
    if not clashes:
        return seen
    # Rescan only on failure: keeping every path for the error message would double the listing's memory.
    wanted = set(clashes[:5])
    paths: dict[str, list[str]] = {}
    for item in iter_images(sources, recursive, id_from):
        if item.img_id in wanted:
            paths.setdefault(item.img_id, []).append(item.path)
    detail = "; ".join(f"{i!r}: {', '.join(p)}" for i, p in paths.items())
    more = f" (and {len(clashes) - len(wanted)} more)" if len(clashes) > len(wanted) else ""
    hint = "use --id-from relpath" if id_from == "stem" else "rename the files or give each folder once"
    raise InputError(f"{len(clashes)} duplicate image ids in the input{more}: {detail}; {hint}")


def _walk(root: Path, recursive: bool) -> Iterator[Path]:
    seen: set[tuple[int, int]] = set()
    try:
        info = root.stat()
    except OSError as exc:
        raise InputError(f"cannot list folder {str(root)!r}: {exc.strerror}") from exc
    seen.add((info.st_dev, info.st_ino))
    yield from _walk_folder(root, recursive, seen)


def _walk_folder(folder: Path, recursive: bool, seen: set[tuple[int, int]]) -> Iterator[Path]:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as exc:
        raise InputError(f"cannot list folder {str(folder)!r}: {exc.strerror}") from exc
    subdirs = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if _is_folder(entry):
            subdirs.append(entry)
        elif Path(entry.name).suffix.lower() in IMAGE_SUFFIXES:
            yield Path(entry.path)
    if not recursive:
        return
    # real folders before symlinked ones: a link to a sibling is then the one skipped as listed already
    for entry in sorted(subdirs, key=lambda e: e.is_symlink()):
        try:
            info = os.stat(entry.path)  # the folder a link leads to
        except OSError as exc:
            log.warning("skipping folder %r: %s", entry.path, exc.strerror)
            continue
        if (info.st_dev, info.st_ino) in seen:
            log.warning(
                "skipping folder %r: it leads to %r, already listed (a symlink loop or a second link)",
                entry.path,
                os.path.realpath(entry.path),
            )
            continue
        seen.add((info.st_dev, info.st_ino))
        yield from _walk_folder(Path(entry.path), recursive, seen)


def _is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows a symlink
    except OSError:
        return False


def _read_list(list_file: Path, id_from: str) -> Iterator[ImageInput]:
    base = list_file.parent
    # a non-UTF-8 line names a file all the same: its bytes are kept (and its id escaped)
    with open(list_file, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            entry = line.strip()
            if not entry or entry.startswith("#"):
                continue
            path = Path(entry)
            if not path.is_absolute():
                path = base / path
            yield ImageInput(_make_id(path, base, id_from), str(path))


def _make_id(path: Path, root: Path, id_from: str) -> str:
    if id_from == "stem":
        return _readable(path.stem)
    try:
        return _readable(path.relative_to(root).as_posix())
    except ValueError:
        return _readable(path.as_posix().lstrip("/"))


def _readable(name: str) -> str:
    """`name` with the bytes that are not UTF-8 (held as surrogates by Python) written as `\\xNN`."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    return name
