"""What `xmodal submit` uploads as the Ray Job's working dir: the code, never secrets, weights or data
unless asked for; listed, sized and refused over Ray's limit before anything is sent."""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
    "unreadable": "unreadable",
    "special": "pipes, sockets and devices",
}


@dataclass
class Upload:
    """The files Ray will package from `root` (relative POSIX paths and sizes), the `excludes` that make it
    do so, and what was left out, by kind (secret, link, unreadable, special, weights, data)."""

    root: Path
    excludes: list[str]
    files: dict[str, int] = field(default_factory=dict)
    left_out: dict[str, list[str]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

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
    """The runtime_env `excludes`: caches, weights and data, `include` patterns re-included, then secrets
    (after the includes, so that none of them can put a key back)."""
    guarded = [pattern for patterns in GUARDED.values() for pattern in patterns]
    return [*CACHES, *guarded, *(f"!{pattern}" for pattern in include), *SECRETS]


def plan_upload(
    working_dir: str | Path,
    include: Sequence[str] = (),
    limit: int | None = None,
    max_entries: int = MAX_ENTRIES,
) -> Upload:
    """List what Ray will upload from `working_dir` (its own traversal, default excludes, .gitignore and
    .rayignore rules, then ours); ValueError naming the largest files when it exceeds `limit` bytes
    (default: Ray's upload limit, the gRPC message size), or when the folder holds more than
    `max_entries` files and folders.

    Links are never followed out of the folder: a link whose target is outside it, a folder, missing, or
    a file left out by the rules is left out itself, as are unreadable files and folders and pipes,
    sockets and devices. Each gets an exact exclude, so Ray's own walk (which follows links) skips it too.
    """
    from ray._private import ray_constants
    from ray._private.runtime_env import packaging
    from ray._private.thirdparty.pathspec import PathSpec

    root = Path(working_dir).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"--working-dir {root} is not a folder")
    excludes = upload_excludes(include)
    upload = Upload(root, excludes)
    spec = PathSpec.from_lines("gitwildmatch", ray_constants.get_runtime_env_default_excludes() + excludes)
    kinds = {"secret": PathSpec.from_lines("gitwildmatch", SECRETS)} | {
        kind: PathSpec.from_lines("gitwildmatch", patterns) for kind, patterns in GUARDED.items()
    }
    seen = 0

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
        upload.excludes.append(_literal(relative))
        return True

    def take(path: Path) -> None:
        if path.is_file():
            upload.files[path.relative_to(root).as_posix()] = path.stat().st_size

    include_gitignore = os.environ.get(ray_constants.RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"
    packaging._dir_travel(root, [excluded], take, include_gitignore=include_gitignore, logger=log)
    limit = packaging.GCS_STORAGE_MAX_SIZE if limit is None else limit
    if upload.total_bytes >= limit:
        largest = sorted(upload.files.items(), key=lambda kv: -kv[1])[:3]
        shown = ", ".join(f"{name} ({_mib(size)})" for name, size in largest)
        raise ValueError(
            f"--working-dir {root} holds {_mib(upload.total_bytes)} to upload, over Ray's {_mib(limit)} "
            f"limit (largest: {shown}); move them out, or list them in {root / '.rayignore'}"
        )
    return upload


def _literal(relative: str) -> str:
    """A gitignore pattern matching exactly `relative` (and what is under it) from the root: glob
    characters escaped, spaces as [ ] (a trailing escaped space would be stripped)."""
    return "/" + re.sub(r"([\\\[\]*?!#])", r"\\\1", relative).replace(" ", "[ ]")


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _examples(paths: list[str], shown: int = 3) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more
