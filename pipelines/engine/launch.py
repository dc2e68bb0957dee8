"""Where the loop runs: in this process, under `torchrun` (WORLD_SIZE > 1), or on Ray Train workers."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from pipelines.engine.checkpoints import CHECKPOINTS, latest_checkpoint
from pipelines.engine.run_history import RAY_RUN, check_resume
from pipelines.engine.trainer import RunStopped, Task, TrainConfig, TrainingRun, run_config
from pipelines.engine.worker_errors import original_error

STOPPED = "stopped.txt"  # a Ray Train run's workers stopped together on bad input: the line to print


def fit(task: Task, cfg: TrainConfig, out_dir: str | Path, resume: bool = False) -> dict:
    """Train `task` into `out_dir` and return the run summary (also written as summary.json).

    Run directory: config.yaml (as the run began), history.jsonl (each start and its settings),
    metrics.jsonl, checkpoints/step-N/ (task files + trainer_state.pt), last/, best/ (when the task has a
    primary metric), curves.png, tensorboard/ (if installed), ray_run.txt (on Ray Train: whose restarted
    workers resume). A resume that changes a setting other than the run's length, placement or logging is
    refused by name (`run_history.RESUMABLE`); a Ray Train run's own restart after a lost worker is no new
    start and goes on from its newest checkpoint."""
    out_dir = Path(out_dir)
    # refused here, before any worker starts: on Ray Train a worker's error would be retried
    latest = latest_checkpoint(out_dir / CHECKPOINTS)
    if latest is not None and not resume:
        raise FileExistsError(
            f"{out_dir} already holds a run (checkpoint {latest.name}); pass --resume to continue it or "
            "choose another output directory"
        )
    if latest is not None:
        check_resume(out_dir, run_config(task, cfg))
    if cfg.workers > 0:
        return _fit_ray(task, cfg, out_dir, resume)
    return train_worker(task, cfg, out_dir, resume)


def _fit_ray(task: Task, cfg: TrainConfig, out_dir: Path, resume: bool) -> dict:
    import cloudpickle
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
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
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    storage = ray_storage(cfg, out_dir)
    run_id = uuid.uuid4().hex
    trainer = TorchTrainer(
        _ray_worker_entry,
        # the task travels pickled and is unpickled after the worker has moved to the driver's folder: Ray
        # Train starts workers in a trial folder, where relative paths (stores, --init) name nothing
        train_loop_config={
            "task": cloudpickle.dumps(task),
            "cwd": os.getcwd(),
            "cfg": cfg,
            "out_dir": str(out_dir),
            "resume": resume,
            "in_place": storage.in_place,
            "run_id": run_id,
        },
        scaling_config=ScalingConfig(
            num_workers=cfg.workers, use_gpu=gpus > 0, resources_per_worker=resources
        ),
        run_config=RunConfig(
            name=storage.name,
            storage_path=storage.path,
            failure_config=FailureConfig(max_failures=cfg.max_failures),
            # in the run directory the trainer's own retention (keep_checkpoints) prunes checkpoints/
            checkpoint_config=CheckpointConfig(
                num_to_keep=None if storage.in_place else cfg.keep_checkpoints
            ),
        ),
    )
    stopped = out_dir / STOPPED
    stopped.unlink(missing_ok=True)
    # checked above: the directory holds no checkpoint, or this is a resume; from here on it is this run's,
    # and the step-N its workers find after a restart are their own
    (out_dir / RAY_RUN).write_text(f"{run_id}\n")
    try:
        trainer.fit()
    except ray.train.TrainingFailedError as exc:
        raise original_error(exc) from exc
    if stopped.is_file():  # every worker stopped together on one's bad input: its one line
        raise RunStopped(stopped.read_text().strip())
    return json.loads((out_dir / "summary.json").read_text())


@dataclass(frozen=True)
class RayStorage:
    """Where Ray Train keeps a run: `path`/`name`; `in_place` when that is the run's own checkpoints/."""

    path: str
    name: str
    in_place: bool


def ray_storage(cfg: TrainConfig, out_dir: Path) -> RayStorage:
    """The run directory's checkpoints/ by default: rank 0 writes checkpoints/step-N there and reports it
    without a copy. A separate `storage_path` gets a copy of each, under a name unique to the run
    directory, so that a rerun of the same run finds its own checkpoints and no other run's."""
    if cfg.storage_path is None:
        return RayStorage(str(out_dir), CHECKPOINTS, in_place=True)
    digest = hashlib.sha1(str(out_dir).encode()).hexdigest()[:8]
    path = cfg.storage_path
    if "://" not in path:
        path = str(Path(path).resolve())
    return RayStorage(path, f"{out_dir.name}-{digest}", in_place=False)


def _ray_worker_entry(loop_config: dict) -> None:
    import cloudpickle
    import ray.train

    if Path(loop_config["cwd"]).is_dir():  # on another node it exists when on shared storage
        os.chdir(loop_config["cwd"])
    task = cloudpickle.loads(loop_config["task"])  # the driver's own task object, pickled just above
    reporter = RayReporter(loop_config["in_place"])
    out_dir, cfg = Path(loop_config["out_dir"]), loop_config["cfg"]
    # after a lost worker Ray Train restarts every worker: a resume of this same run, from the checkpoint
    # Ray hands back (this run's last reported), else from the run's own newest step-N (written, not yet
    # reported: Ray holds none before the first report completes). In place, Ray's checkpoint is one of
    # those step-N directories and the newest is at least as new (the one before may be pruned already)
    checkpoint = ray.train.get_checkpoint()
    resume = loop_config["resume"] or checkpoint is not None or _restarted(out_dir, loop_config["run_id"])
    try:
        if checkpoint is None or loop_config["in_place"]:
            TrainingRun(task, cfg, out_dir, resume, reporter=reporter).train()
            return
        with checkpoint.as_directory() as directory:
            TrainingRun(task, cfg, out_dir, True, reporter=reporter, restore_from=Path(directory)).train()
    except RunStopped as exc:
        # all workers stop here together: a normal end for Ray (no retry of bad input, no traceback in
        # the log), and the driver raises the line rank 0 leaves
        if ray.train.get_context().get_world_rank() == 0:
            (out_dir / STOPPED).write_text(f"{exc}\n")


def _restarted(out_dir: Path, run_id: str) -> bool:
    """Whether `out_dir` holds a checkpoint written by an earlier attempt of this same Ray Train run; one
    from any other run (a concurrent start into the same directory) is still refused."""
    marker = out_dir / RAY_RUN
    mine = marker.is_file() and marker.read_text().strip() == run_id
    return mine and latest_checkpoint(out_dir / CHECKPOINTS) is not None


class RayReporter:
    """`ray.train.report` from every worker at the steps the run logs or checkpoints: metrics for the Ray
    dashboard, and rank 0's checkpoint directory as the run's `Checkpoint`."""

    def __init__(self, in_place: bool):
        self.in_place = in_place

    def __call__(self, step: int, metrics: dict[str, float], checkpoint: Path | None) -> None:
        import ray.train

        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if checkpoint is None:
            ray.train.report(numbers)
            return
        mine = ray.train.get_context().get_world_rank() == 0  # rank 0 wrote it; the others only report
        ray.train.report(
            numbers,
            checkpoint=ray.train.Checkpoint.from_directory(str(checkpoint)) if mine else None,
            checkpoint_dir_name=checkpoint.name,
            # written in place, the directory already is where Ray keeps the run: nothing to copy
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD
            if self.in_place
            else ray.train.CheckpointUploadMode.SYNC,
        )


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
