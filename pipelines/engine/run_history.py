"""What a run directory says about its own settings: config.yaml as the run began (never rewritten),
history.jsonl one line per start with what was given then, and the resume check that refuses by name a
setting that would change what the run learns."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipelines.engine import config_io
from pipelines.engine.checkpoints import CHECKPOINTS, latest_checkpoint

CONFIG_FILE = "config.yaml"
HISTORY_FILE = "history.jsonl"
# what a fork leaves behind: the records of the source run's own starts and results
RAY_RUN = "ray_run.txt"  # the id of the Ray Train run that owns the directory: its restarted workers resume
_NOT_FORKED = (CONFIG_FILE, HISTORY_FILE, "summary.json", "curves.png", RAY_RUN)
# What a resume may change: how long the run goes on, where it runs and how it is watched. Everything
# else (rates, schedule, data, model, seeds) would make the rest of the run a different one.
RESUMABLE = frozenset(
    f"train.{name}"
    for name in (
        "max_steps",
        "epochs",
        "save_every",
        "keep_checkpoints",
        "log_every",
        "progress",
        "trackers",
        "eval_every",
        "eval_batch_size",
        "loader_workers",
        "device",
        "compile",
        "workers",
        "gpus_per_worker",
        "cpus_per_worker",
        "ray_address",
        "max_failures",
        "storage_path",
    )
)


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as dotted keys: {"train": {"lr": 1}} -> {"train.lr": 1}."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def current_config(out_dir: Path) -> dict[str, Any] | None:
    """The settings of the run's latest start (history.jsonl), else its config.yaml, else None."""
    last = _last_start(out_dir)
    if last:
        return last["config"]
    if (out_dir / CONFIG_FILE).is_file():
        return config_io.load_yaml(out_dir / CONFIG_FILE)
    return None


def changed(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose value differs: key -> (before, now)."""
    old, new = flatten(before), flatten(now)
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def check_resume(out_dir: Path, config: Mapping[str, Any]) -> None:
    """ValueError naming every setting that differs from the run's, except the `RESUMABLE` ones; a run
    just forked takes any settings (its first start records what changed)."""
    before = current_config(out_dir)
    if before is None or _last_start(out_dir).get("start") == "fork":
        return
    refused = {k: v for k, v in changed(before, config).items() if k not in RESUMABLE}
    if refused:
        shown = "; ".join(f"{k} was {_show(a)}, now {_show(b)}" for k, (a, b) in refused.items())
        raise ValueError(
            f"{out_dir} cannot resume with other settings ({shown}): resume with the run's own values "
            f"(they are in {out_dir / HISTORY_FILE}), or train the new settings into another --out"
        )


def record_start(out_dir: Path, config: Mapping[str, Any], step: int) -> None:
    """At step 0 (a new run), write config.yaml and start the history afresh; append this start (step,
    time, settings, what changed since the start before)."""
    if step == 0:
        (out_dir / HISTORY_FILE).unlink(missing_ok=True)
    if step == 0 or not (out_dir / CONFIG_FILE).is_file():  # a new run, or a fork's first start
        config_io.save_yaml(dict(config), out_dir / CONFIG_FILE)
    before = current_config(out_dir)
    row = {
        "start": "resume" if step > 0 else "new",
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "changed": {k: list(v) for k, v in changed(before, config).items()} if before is not None else {},
        "config": dict(config),
    }
    with (out_dir / HISTORY_FILE).open("a") as f:
        f.write(json.dumps(row) + "\n")


def fork(source: Path, out_dir: Path) -> int:
    """Make `out_dir` a new run that goes on from `source`'s newest checkpoint (weights, optimizer, step),
    with the run's other files (metrics.jsonl, vocabularies); resumed, it takes new settings and records
    them against `source`'s. Returns the step; ValueError naming what is missing or in the way."""
    latest = latest_checkpoint(source / CHECKPOINTS)
    if latest is None:
        raise ValueError(f"--fork {source}: no checkpoint to go on from in {source / CHECKPOINTS}")
    mine = latest_checkpoint(out_dir / CHECKPOINTS)
    if mine is not None:
        raise ValueError(
            f"--out {out_dir} already holds a run (checkpoint {mine.name}); fork into a new --out"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name not in _NOT_FORKED:
            shutil.copy2(item, out_dir / item.name)
    shutil.copytree(latest, out_dir / CHECKPOINTS / latest.name)
    step = int(latest.name.removeprefix("step-"))
    row = {
        "start": "fork",
        "from": str(source.resolve()),
        "step": step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": current_config(source),
    }
    (out_dir / HISTORY_FILE).write_text(json.dumps(row) + "\n")
    (out_dir / CONFIG_FILE).unlink(missing_ok=True)
    return step


def _last_start(out_dir: Path) -> dict[str, Any]:
    history = out_dir / HISTORY_FILE
    lines = [line for line in history.read_text().splitlines() if line.strip()] if history.is_file() else []
    return json.loads(lines[-1]) if lines else {}


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value
