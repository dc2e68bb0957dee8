"""What `xmodal submit` uploads as the Ray Job's working dir: the code, never secrets, weights or data
unless asked for; listed, sized and refused over Ray's limit before anything is sent, then packaged from
that list alone (`write_package`), never by a walk of its own."""

from __future__ import annotations

import logging
import os
import stat
import zipfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, NamedTuple

log = logging.getLogger(__name__)

# Machine-local folders and caches: never useful on the cluster.
CACHES = (
    ".venv",
    "venv",
    "demo_run",
    "runs",
    ".git",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    "node_modules",
)
# Keys and credential files: never uploaded, wherever they are, whatever --include says (gitignore-style).
SECRETS = (
    ".env",
    ".env.*",
    "*.env",
    ".envrc",
    "*.pem",
    "*.key",
    "*.p12",
    "*.pfx",
    "*.ppk",
    "*.jks",
    "*.keystore",
    "id_rsa*",
    "id_dsa*",
    "id_ecdsa*",
    "id_ed25519*",
    "id_xmss*",
    ".netrc",
    ".pgpass",
    ".pypirc",
    ".npmrc",
    ".git-credentials",
    "credentials",
    "credentials.*",
    "application_default_credentials.json",
    "secrets.*",
    "*.secret",
    "*auth_token*",
    "*.token",
    ".ssh",
    ".aws",
    ".azure",
    "**/.config/gcloud",
    ".gnupg",
    ".docker",
    ".kube",
    ".ray",
)
# Left out by default and reported, so that a user sees what stayed home; --include puts them back.
GUARDED = {
    "weights": ("*.pt", "*.pth", "*.bin", "*.safetensors", "*.ckpt", "*.pkl", "*.pickle", "*.onnx"),
    "data": (
        "*.lmdb",
        "*.mdb",
        "*.h5",
        "*.hdf5",
        "*.tsv",
        "*.npy",
        "*.npz",
        "*.parquet",
        "*.arrow",
        "*.zip",
        "*.tar",
        "*.tgz",
        "*.gz",
        "*.xz",
        "*.bz2",
        "*.zst",
        "*.7z",
        "*.rar",
        "*.whl",
        "*.egg",
        "*.jpg",
        "*.jpeg",
        "*.png",
        "*.bmp",
        "*.webp",
        "*.tif",
        "*.tiff",
        "*.gif",
    ),
}


MAX_ENTRIES = 100_000  # files and folders looked at before the walk gives up: a code folder holds far fewer
# left-out kinds that --include cannot put back
NEVER = {
    "secret": "keys and credential files",
    "link": "links leaving the folder or to folders",
    "hardlink": "files hard-linked from outside the folder",
    "unreadable": "unreadable",
    "special": "pipes, sockets and devices",
}


class Source(NamedTuple):
    """The file a planned name is read from (itself, or the file inside the folder a link names), as
    the plan saw it: the package refuses any other file found there later."""

    path: str
    device: int
    inode: int
    links: int


@dataclass
class Upload:
    """The files to package from `root` (relative POSIX paths and sizes), the patterns the plan was made
    with, and what was left out, by kind (secret, link, hardlink, unreadable, special, weights, data)."""

    root: Path
    excludes: list[str]
    files: dict[str, int] = field(default_factory=dict)
    left_out: dict[str, list[str]] = field(default_factory=dict)
    sources: dict[str, Source] = field(default_factory=dict, repr=False)
    limit: int | None = None

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    def over_limit(self) -> str | None:
        """Why the upload is refused for its size (naming the largest files), or None."""
        if self.limit is None or self.total_bytes < self.limit:
            return None
        largest = sorted(self.files.items(), key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{name} ({_mib(size)})" for name, size in largest)
        return (
            f"--working-dir {self.root} holds {_mib(self.total_bytes)} to upload, over Ray's "
            f"{_mib(self.limit)} limit (largest: {shown}); move them out, or list them in "
            f"{self.root / '.rayignore'}"
        )

    def listing(self) -> str:
        """Every file to upload with its size, then every file left out, by kind: `--dry-run`'s plan."""
        lines = [f"{size:>12,}  {name}" for name, size in sorted(self.files.items())]
        for kind, paths in self.left_out.items():
            lines += [f"{'left out':>12}  {path}  ({kind})" for path in sorted(paths)]
        return "\n".join(lines)

    def describe(self) -> str:
        """One line: what goes up, its size, and what stayed home."""
        line = f"uploading {len(self.files)} files ({_mib(self.total_bytes)}, uncompressed) from {self.root}"
        kept = [f"{len(paths)} {kind} ({_examples(paths)})" for kind, paths in self.left_out.items()]
        if kept:
            line += f"; left out: {', '.join(kept)}"
            if set(self.left_out) - set(NEVER):
                line += "; upload weights or data with --include PATTERN"
            never = [NEVER[kind] for kind in NEVER if kind in self.left_out]
            if never:
                line += f" ({', '.join(never)} never go up)"
        return line


def upload_excludes(include: Sequence[str] = ()) -> list[str]:
    """The plan's gitignore-style excludes: caches, weights and data, `include` patterns re-included, then
    secrets (after the includes, so that none of them can put a key back). Weights, data, secrets and
    includes match whatever the case of their letters (`photo.JPG`, `ID_RSA`)."""
    guarded = [_any_case(pattern) for patterns in GUARDED.values() for pattern in patterns]
    included = [f"!{_any_case(pattern)}" for pattern in include]
    return [*CACHES, *guarded, *included, *(_any_case(pattern) for pattern in SECRETS)]


def plan_upload(
    working_dir: str | Path,
    include: Sequence[str] = (),
    limit: int | None = None,
    max_entries: int = MAX_ENTRIES,
    strict: bool = True,
) -> Upload:
    """List what to upload from `working_dir` (Ray's traversal, default excludes, .gitignore and
    .rayignore rules, then ours); ValueError naming the largest files when it exceeds `limit` bytes
    (default: Ray's upload limit, the gRPC message size) unless not `strict` (then `over_limit()` says
    it), or when the folder holds more than `max_entries` files and folders.

    Links are never followed out of the folder: a link whose target is outside it, a folder, missing, or
    a file left out by the rules is left out itself, as are files with a hard link outside the folder
    (more links than names for them here), unreadable files and folders and pipes, sockets and devices.
    """
    from ray._private import ray_constants
    from ray._private.runtime_env import packaging
    from ray._private.thirdparty.pathspec import PathSpec

    root = Path(working_dir).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"--working-dir {root} is not a folder")
    excludes = upload_excludes(include)
    limit = packaging.GCS_STORAGE_MAX_SIZE if limit is None else limit
    upload = Upload(root, excludes, limit=limit)
    spec = PathSpec.from_lines("gitwildmatch", ray_constants.get_runtime_env_default_excludes() + excludes)
    kinds = {"secret": SECRETS, **GUARDED}
    kinds = {
        kind: PathSpec.from_lines("gitwildmatch", [_any_case(p) for p in patterns])
        for kind, patterns in kinds.items()
    }
    seen = 0
    names: Counter[tuple[int, int]] = Counter()  # hard links to each file found in the folder
    unnamed: list[str] = []  # names a package cannot hold (not UTF-8)

    def kind_of(relative: str) -> str | None:
        return next((k for k, s in kinds.items() if s.match_file(relative)), None)

    def refusal(path: Path) -> str | None:
        """Why `path` must not go up although no pattern names it, or None."""
        try:
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                target = path.resolve(strict=True)
                if not target.is_relative_to(root) or target.is_dir():
                    return "link"
                relative = target.relative_to(root).as_posix()
                if spec.match_file(relative):  # a link to a key (or weights) inside the folder
                    return kind_of(relative) or "link"
                mode = target.stat().st_mode
        except (OSError, RuntimeError):  # gone, dangling, or a loop of links
            return "link" if path.is_symlink() else "unreadable"
        if stat.S_ISDIR(mode):
            return None if os.access(path, os.R_OK | os.X_OK) else "unreadable"
        if stat.S_ISREG(mode):
            return None if os.access(path, os.R_OK) else "unreadable"
        return "special"

    def excluded(path: Path) -> bool:
        nonlocal seen
        seen += 1
        if seen > max_entries:
            raise ValueError(
                f"--working-dir {root} holds more than {max_entries} files and folders; point it at the "
                f"code folder, or list the big folders in {root / '.rayignore'}"
            )
        relative = path.absolute().relative_to(root).as_posix()
        if relative == ".":
            return False
        if spec.match_file(relative):
            kind = kind_of(relative)
            if kind is not None:
                upload.left_out.setdefault(kind, []).append(relative)
            return True
        kind = refusal(path)
        if kind is None:
            return False
        upload.left_out.setdefault(kind, []).append(relative)
        return True

    def take(path: Path) -> None:
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode):
            return
        relative = path.relative_to(root).as_posix()
        if not _encodable(relative):
            unnamed.append(relative)
            return
        source = relative
        if stat.S_ISLNK(info.st_mode):  # a link to a file inside the folder: that file goes up under its name
            target = path.resolve(strict=True)
            source, info = target.relative_to(root).as_posix(), target.lstat()
        else:
            names[info.st_dev, info.st_ino] += 1
        upload.files[relative] = info.st_size
        upload.sources[relative] = Source(source, info.st_dev, info.st_ino, info.st_nlink)

    include_gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    packaging._dir_travel(root, [excluded], take, include_gitignore=include_gitignore, logger=log)
    if unnamed:
        shown = ", ".join(
            str(root / name).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            for name in unnamed[:3]
        )
        more = f" and {len(unnamed) - 3} more" if len(unnamed) > 3 else ""
        raise ValueError(
            f"--working-dir {root} holds {len(unnamed)} files whose names are not UTF-8, which a package "
            f"cannot hold: {shown}{more}; rename them, or list them in {root / '.rayignore'}"
        )
    for relative, source in list(upload.sources.items()):
        # more hard links than names for the file here: another name (a key?) lives outside the folder,
        # or a link names a file the rules left out
        if source.links > names[source.device, source.inode]:
            del upload.files[relative], upload.sources[relative]
            upload.left_out.setdefault("hardlink" if source.links > 1 else "link", []).append(relative)
    if strict and (refused := upload.over_limit()):
        raise ValueError(refused)
    return upload


def write_package(upload: Upload, destination: str | Path) -> Path:
    """Zip exactly the planned files into `destination` (a working_dir package, as Ray's own, without a
    top folder): each opened without following any link, and refused unless it is still the regular file
    the plan listed. Deterministic, so that the same code is the same package (Ray uploads it once)."""
    destination = Path(destination)
    root = os.open(upload.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with zipfile.ZipFile(destination, "w", zipfile.ZIP_DEFLATED) as package:
            for name in sorted(upload.files):
                source = upload.sources[name]
                with os.fdopen(_open_planned(root, source, upload.root), "rb") as file:
                    member = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                    member.compress_type = zipfile.ZIP_DEFLATED
                    mode = stat.S_IMODE(os.fstat(file.fileno()).st_mode)
                    member.external_attr = (stat.S_IFREG | mode) << 16
                    with package.open(member, "w", force_zip64=True) as out:
                        _copy_planned(file, out, upload.files[name], upload.root / name)
    finally:
        os.close(root)
    return destination


def _copy_planned(file: BinaryIO, out: BinaryIO, size: int, shown: Path) -> None:
    """Copy exactly the `size` bytes the plan listed (its limit was checked against them); a file that
    grew or shrank since is refused, also when it changes during the copy."""
    left = size
    while left and (chunk := file.read(min(left, 1 << 20))):
        out.write(chunk)
        left -= len(chunk)
    if left or file.read(1):
        now = os.fstat(file.fileno()).st_size
        raise ValueError(
            f"{shown} changed after it was listed ({size:,} bytes planned, {now:,} now); submit again"
        )


def _encodable(name: str) -> bool:
    """Whether `name` (as the file system decoded it) can be written into a package: UTF-8."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _open_planned(root: int, source: Source, shown: Path) -> int:
    """A descriptor of `source` under the folder `root`, each part opened without following links."""
    parts = source.path.split("/")
    folders: list[int] = []
    try:
        parent = root
        for part in parts[:-1]:
            parent = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
            folders.append(parent)
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
    except OSError as exc:
        raise ValueError(
            f"{shown / source.path} changed after it was listed ({exc.strerror}); submit again"
        ) from None
    finally:
        for folder in folders:
            os.close(folder)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or (info.st_dev, info.st_ino) != (source.device, source.inode):
        os.close(fd)
        raise ValueError(f"{shown / source.path} changed after it was listed; submit again")
    return fd


def _any_case(pattern: str) -> str:
    """`pattern` matching names whatever the case of their letters: `*.jpg` -> `*.[jJ][pP][gG]`."""
    out, bracket, i = [], False, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":  # an escaped character stays as written
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if bracket or not char.isalpha() or char.lower() == char.upper():
            out.append(char)
            bracket = (bracket and char != "]") or (not bracket and char == "[")
        else:
            out.append(f"[{char.lower()}{char.upper()}]")
        i += 1
    return "".join(out)


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _examples(paths: list[str], shown: int = 3) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more
