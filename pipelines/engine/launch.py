"""Where the loop runs: in this process, under `torchrun` (WORLD_SIZE > 1), or on Ray Train workers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from pipelines.engine.trainer import Task, TrainConfig, TrainingRun


def fit(task: Task, cfg: TrainConfig, out_dir: str | Path, resume: bool = False) -> dict:
    """Train `task` into `out_dir` and return the run summary (also written as summary.json).

    Run directory: config.yaml, metrics.jsonl, checkpoints/step-N/ (task files + trainer_state.pt),
    last/, best/ (when the task has a primary metric), curves.png, tensorboard/ (if installed)."""
    out_dir = Path(out_dir)
    if cfg.workers > 0:
        return _fit_ray(task, cfg, out_dir, resume)
    return train_worker(task, cfg, out_dir, resume)


def _fit_ray(task: Task, cfg: TrainConfig, out_dir: Path, resume: bool) -> dict:
    import cloudpickle
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if not ray.is_initialized():
        raise ValueError(
            f"workers={cfg.workers} trains on Ray, but no Ray session is open; open one with "
            "pipelines.jobs.ray_runtime.ray_for_workers (the training commands do)"
        )
    gpus = cfg.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    resources = {"CPU": cfg.cpus_per_worker}
    if gpus > 0:
        resources["GPU"] = gpus
    out_dir.mkdir(parents=True, exist_ok=True)
    trainer = TorchTrainer(
        _ray_worker_entry,
        # the task travels pickled and is unpickled after the worker has moved to the driver's folder: Ray
        # Train starts workers in a trial folder, where relative paths (stores, --init) name nothing
        train_loop_config={
            "task": cloudpickle.dumps(task),
            "cwd": os.getcwd(),
            "cfg": cfg,
            "out_dir": str(out_dir.resolve()),
            "resume": resume,
        },
        scaling_config=ScalingConfig(
            num_workers=cfg.workers, use_gpu=gpus > 0, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=f"train-{time.strftime('%Y%m%d-%H%M%S')}", storage_path=str((out_dir / "ray").resolve())
        ),
    )
    trainer.fit()
    return json.loads((out_dir / "summary.json").read_text())


def _ray_worker_entry(loop_config: dict) -> None:
    import cloudpickle

    if Path(loop_config["cwd"]).is_dir():  # on another node it exists when on shared storage
        os.chdir(loop_config["cwd"])
    task = cloudpickle.loads(loop_config["task"])  # the driver's own task object, pickled just above
    train_worker(task, loop_config["cfg"], Path(loop_config["out_dir"]), loop_config["resume"])


def train_worker(task: Task, cfg: TrainConfig, out_dir: str | Path, resume: bool = False) -> dict:
    """The per-worker loop. A process group already set up (Ray Train) is used; WORLD_SIZE > 1 in the
    environment (torchrun) initialises one from env://; otherwise a single process trains."""
    out_dir = Path(out_dir)
    dist = torch.distributed
    owns_group = False
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method="env://")
        owns_group = True
    try:
        return TrainingRun(task, cfg, out_dir, resume).train()
    finally:
        if owns_group:
            dist.destroy_process_group()
