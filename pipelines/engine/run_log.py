"""The run log: metrics.jsonl rows, mirrored to the console and TensorBoard, and curves.png from them."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"


class RunLog:
    """Rows of one run directory; only the main worker writes (`enabled`)."""

    def __init__(self, out_dir: Path, enabled: bool) -> None:
        self.out_dir = out_dir
        self.path = out_dir / METRICS_FILE
        self.enabled = enabled
        self.tb = None

    def open(self, step: int) -> None:
        """Start (or resume at `step`: later rows are dropped, they will be logged again)."""
        if not self.enabled:
            return
        _truncate_metrics(self.path, step)
        self.tb = _tensorboard(self.out_dir / "tensorboard")

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        log.info("%s", shown)
        if self.tb is not None:
            for k, v in row.items():
                if k not in ("step", "epoch") and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])

    def curves(self) -> None:
        if self.enabled:
            write_curves(self.path, self.out_dir / CURVES_FILE)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


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


def _tensorboard(directory: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            return None
    return SummaryWriter(str(directory))
