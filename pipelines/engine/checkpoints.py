"""Run checkpoints: `checkpoints/step-N/` directories written whole or not at all, retention, the newest."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

STATE_FILE = "trainer_state.pt"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete `checkpoints/step-N` directory, or None."""
    found = [(n, d) for n, d in step_dirs(Path(root)) if (d / STATE_FILE).is_file()]
    return max(found)[1] if found else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        name = d.name
        if d.is_dir() and name.startswith("step-") and name[5:].isdigit():
            found.append((int(name[5:]), d))
    return found


def replace_dir(target: Path, write: Callable[[Path], None]) -> None:
    """Write into a temporary sibling, then swap it in: a crash never leaves a half-written directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    old = target.with_name(f".{target.name}.old")
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` step directories."""
    for _, old in sorted(step_dirs(root))[:-keep]:
        shutil.rmtree(old)
