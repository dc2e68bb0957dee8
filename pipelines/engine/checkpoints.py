"""Run checkpoints: `checkpoints/step-N/` directories written whole or not at all, retention, the newest."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

CHECKPOINTS = "checkpoints"  # the run directory's folder of step-N directories
STATE_FILE = "trainer_state.pt"
STATE_KEYS = ("model", "optimizer", "scheduler", "step", "batch_size", "micro_batch", "world", "grad_accum")


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


def read_state(path: Path, device: torch.device | str = "cpu") -> dict:
    """The trainer state saved at `path`, read as tensors and plain values only (never pickled code);
    ValueError on one line naming the file, why, and what to do."""
    fix = f"delete {path.parent} to resume from the checkpoint before it, or start a new --out"
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # torch's refusals are UnpicklingError, RuntimeError or EOFError
        raise ValueError(f"{path} cannot be resumed from: {_load_failure(exc)}; {fix}") from exc
    missing = [k for k in STATE_KEYS if k not in state] if isinstance(state, dict) else list(STATE_KEYS)
    if missing:
        raise ValueError(f"{path} is not a trainer state written by xmodal (no {', '.join(missing)}); {fix}")
    return state


def _load_failure(exc: BaseException) -> str:
    text = str(exc)
    if "Weights only load failed" in text:
        found = re.search(r"GLOBAL (\S+)", text)
        what = f"it would import {found.group(1)}" if found else "it is not a tensor-only file"
        return f"{what}, so it was not unpickled (xmodal never runs pickled code)"
    lines = text.strip().splitlines()
    return lines[0] if lines else type(exc).__name__
