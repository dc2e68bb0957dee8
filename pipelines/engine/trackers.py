"""Experiment trackers behind one small interface: TensorBoard, MLflow and Weights & Biases."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class Tracker(Protocol):
    """Receives the run's config once, then every logged row (numbers only) at its step."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Event files under tensorboard/ (needs `tensorboard` or `tensorboardX`; the default tracker, so
    without either it is left out with a note instead of stopping the run)."""

    optional = True

    def __init__(self, out_dir: Path, run_name: str, config: dict) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as exc:
                raise _missing("tensorboard", "tensorboard") from exc
        self.writer = SummaryWriter(str(out_dir / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    """An MLflow run in the tracking URI MLflow is configured with (MLFLOW_TRACKING_URI; default ./mlruns);
    a resumed run continues the MLflow run recorded in the run directory."""

    def __init__(self, out_dir: Path, run_name: str, config: dict) -> None:
        try:
            import mlflow
        except ImportError as exc:
            raise _missing("mlflow", "mlflow") from exc
        self.mlflow = mlflow
        id_file = out_dir / "mlflow_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else None
        self.run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_name)
        if run_id is None:
            id_file.write_text(self.run.info.run_id + "\n")
            mlflow.log_params({k: str(v)[:500] for k, v in _flat(config).items()})

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class WandbTracker:
    """A Weights & Biases run (online or WANDB_MODE=offline, files under the run directory); a resumed
    run continues the W&B run recorded in the run directory."""

    def __init__(self, out_dir: Path, run_name: str, config: dict) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _missing("wandb", "wandb") from exc
        id_file = out_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            id=run_id,
            resume="allow",
            name=run_name,
            config=config,
            dir=str(out_dir),
            reinit="finish_previous",
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


TRACKERS: dict[str, type] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MLflowTracker,
    "wandb": WandbTracker,
}


def open_trackers(names: list[str], out_dir: Path, config: dict) -> list[Tracker]:
    """The trackers named in `train.trackers`; an unknown or uninstalled one stops the run before training."""
    unknown = sorted(set(names) - set(TRACKERS))
    if unknown:
        raise ValueError(f"unknown tracker(s) {unknown} in train.trackers; choose from {sorted(TRACKERS)}")
    opened = []
    for name in dict.fromkeys(names):
        try:
            opened.append(TRACKERS[name](out_dir, out_dir.name, config))
        except ValueError as exc:
            if not getattr(TRACKERS[name], "optional", False):
                raise
            log.info("%s", exc)
    return opened


def _missing(name: str, extra: str) -> ValueError:
    return ValueError(
        f"train.trackers includes {name} but it is not installed: pip install 'xmodal[{extra}]' "
        f"or drop it from train.trackers"
    )


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
