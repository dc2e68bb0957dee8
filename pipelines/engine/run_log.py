"""The run log: metrics.jsonl rows, mirrored to the console (progress) and the trackers, and curves.png."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path

from pipelines.engine.trackers import Tracker, open_trackers

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
PROGRESS_MODES = ("auto", "bar", "log")


class RunLog:
    """Rows of one run directory, mirrored to the trackers and the console; only the main worker writes
    (`enabled`)."""

    def __init__(self, out_dir: Path, enabled: bool, trackers: list[str], progress: str = "auto") -> None:
        self.out_dir = out_dir
        self.path = out_dir / METRICS_FILE
        self.enabled = enabled
        self.tracker_names = trackers
        self.progress_mode = progress
        self.trackers: list[Tracker] = []
        self.progress: Progress | None = None
        self.drawn = False  # curves.png shows every row logged so far (drawing takes seconds)

    def open(self, step: int, total_steps: int, config: dict) -> None:
        """Start (or resume at `step`: later rows are dropped, they will be logged again)."""
        if not self.enabled:
            return
        _truncate_metrics(self.path, step)
        self.trackers = open_trackers(self.tracker_names, self.out_dir, config)
        self.progress = Progress(step, total_steps, self.progress_mode)

    def advance(self, step: int) -> None:
        """One optimizer step done."""
        if self.progress is not None:
            self.progress.advance(step)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        self.drawn = False
        if self.progress is not None:
            self.progress.show(row)
        numbers = {k: float(v) for k, v in row.items() if k not in ("step", "epoch") and _is_number(v)}
        for tracker in self.trackers:
            tracker.log(numbers, row["step"])

    def curves(self) -> None:
        """Draw curves.png unless it already shows every row (the last checkpoint and the run's end)."""
        if self.enabled and not (self.drawn and (self.out_dir / CURVES_FILE).is_file()):
            write_curves(self.path, self.out_dir / CURVES_FILE)
            self.drawn = True

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self.progress is not None:
            self.progress.close()
            self.progress = None


class Progress:
    """Training progress on the console: a bar (step, loss, samples/s, ETA) on a terminal, else the logged
    rows as plain lines with an ETA. `mode`: auto (bar when stderr is a terminal), bar or log."""

    def __init__(self, step: int, total_steps: int, mode: str = "auto") -> None:
        if mode not in PROGRESS_MODES:
            raise ValueError(f"train.progress must be one of {PROGRESS_MODES}, got {mode!r}")
        self.first, self.total = step, total_steps
        self.start = time.perf_counter()
        self.bar = None
        if mode == "bar" or (mode == "auto" and sys.stderr.isatty()):
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=step, unit="step", desc="training", dynamic_ncols=True)

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def eta(self, step: int) -> float | None:
        done = step - self.first
        return (self.total - step) * (time.perf_counter() - self.start) / done if done > 0 else None

    def show(self, row: dict) -> None:
        if self.bar is not None:
            shown = {k: row[k] for k in ("loss", "samples_per_s") if k in row}
            shown.update({k: v for k, v in row.items() if k.startswith("valid_")})
            self.bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in shown.items()})
            return
        text = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        eta = self.eta(row["step"]) if "step" in row else None
        log.info(
            "%s/%s %s%s",
            row.get("step"),
            self.total,
            text,
            f" eta={_duration(eta)}" if eta is not None else "",
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl ([] when there is none yet)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_curves(metrics_path: Path, out_png: Path) -> None:
    """One panel per loss or metric: training rows as lines, validation rows (valid_*) as markers."""
    rows = read_metrics(metrics_path)
    skip = {"step", "epoch", "lr", "samples_per_s"}
    names: list[str] = []
    for row in rows:
        for k in row:
            base = k.removeprefix("valid_")
            if k not in skip and base not in names and isinstance(row[k], (int, float)):
                names.append(base)
    if not names:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(names))
    nrows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for key, style in ((name, "-"), (f"valid_{name}", "o--")):
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True), style, label="valid" if key.startswith("valid_") else "train"
                )
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop rows logged after the checkpoint being resumed: they will be logged again."""
    rows = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    if path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
