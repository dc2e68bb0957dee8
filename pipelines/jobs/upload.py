"""What `xmodal submit` uploads as the Ray Job's working dir: the code, never secrets, weights or data
unless asked for; listed, sized and refused over Ray's limit before anything is sent."""

from __future__ import annotations

import logging
import os
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
# Left out by default and reported, so that a user sees what stayed home (gitignore-style patterns).
GUARDED = {
    "secret": (
        ".env",
        ".env.*",
        "*.env",
        ".envrc",
        "*.pem",
        "*.key",
        "*.p12",
        "*.pfx",
        "*.keystore",
        "id_rsa*",
        "id_dsa*",
        "id_ecdsa*",
        "id_ed25519*",
        ".netrc",
        ".pypirc",
        ".npmrc",
        ".git-credentials",
        "credentials",
        "credentials.*",
        "secrets.*",
        "*.secret",
        "*auth_token*",
        "*.token",
        ".ssh",
        ".aws",
        ".gnupg",
        ".docker",
        ".kube",
        ".ray",
    ),
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


@dataclass
class Upload:
    """The files Ray will package from `root` (relative POSIX paths and sizes), the `excludes` that make it
    do so, and what the guarded patterns left out, by kind."""

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
            line += f"; left out: {', '.join(kept)}; upload one with --include PATTERN"
        return line


def upload_excludes(include: Sequence[str] = ()) -> list[str]:
    """The runtime_env `excludes`: caches and guarded files, then `include` patterns re-included."""
    guarded = [pattern for patterns in GUARDED.values() for pattern in patterns]
    return [*CACHES, *guarded, *(f"!{pattern}" for pattern in include)]


def plan_upload(working_dir: str | Path, include: Sequence[str] = (), limit: int | None = None) -> Upload:
    """List what Ray will upload from `working_dir` (its own traversal, default excludes, .gitignore and
    .rayignore rules, then ours); ValueError naming the largest files when it exceeds `limit` bytes
    (default: Ray's upload limit, the gRPC message size)."""
    from ray._private import ray_constants
    from ray._private.runtime_env import packaging
    from ray._private.thirdparty.pathspec import PathSpec

    root = Path(working_dir).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"--working-dir {root} is not a folder")
    excludes = upload_excludes(include)
    upload = Upload(root, excludes)
    spec = PathSpec.from_lines("gitwildmatch", ray_constants.get_runtime_env_default_excludes() + excludes)
    kinds = {kind: PathSpec.from_lines("gitwildmatch", patterns) for kind, patterns in GUARDED.items()}

    def excluded(path: Path) -> bool:
        relative = path.absolute().relative_to(root).as_posix()
        if relative == "." or not spec.match_file(relative):
            return False
        kind = next((k for k, s in kinds.items() if s.match_file(relative)), None)
        if kind is not None:
            upload.left_out.setdefault(kind, []).append(relative)
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


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _examples(paths: list[str], shown: int = 3) -> str:
    more = f" and {len(paths) - shown} more" if len(paths) > shown else ""
    return ", ".join(paths[:shown]) + more
