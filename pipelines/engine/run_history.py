"""What a run directory says about its own settings: config.yaml as the run began (never rewritten),
history.jsonl one line per start with what was given then, and the resume check that refuses by name a
setting that would change what the run learns."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipelines.engine import config_io

CONFIG_FILE = "config.yaml"
HISTORY_FILE = "history.jsonl"
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
    history = out_dir / HISTORY_FILE
    if history.is_file():
        lines = [line for line in history.read_text().splitlines() if line.strip()]
        if lines:
            return json.loads(lines[-1])["config"]
    if (out_dir / CONFIG_FILE).is_file():
        return config_io.load_yaml(out_dir / CONFIG_FILE)
    return None


def changed(before: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose value differs: key -> (before, now)."""
    old, new = flatten(before), flatten(now)
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def check_resume(out_dir: Path, config: Mapping[str, Any]) -> None:
    """ValueError naming every setting that differs from the run's, except the `RESUMABLE` ones."""
    before = current_config(out_dir)
    if before is None:
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


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value
