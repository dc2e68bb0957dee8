"""The training loop shared by pre-training and fine-tuning: the Task protocol, and one worker's run
(build, restore, step, validate) with exact resume; checkpoints and the run log are called at fixed points."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from extraction.precision import float32_precision
from model.layers.attention import static_layout
from model.ranges import check_fields
from pipelines.data.batch_transfer import for_transfer
from pipelines.engine import config_io
from pipelines.engine.checkpoints import (
    CHECKPOINTS,
    STATE_FILE,
    latest_checkpoint,
    prune,
    read_state,
    replace_dir,
    step_dir,
)
from pipelines.engine.compiled import CUDA_GRAPHS, compile_mode, compile_model, failure_line, wants_compile
from pipelines.engine.devices import pick_device
from pipelines.engine.model_memory import check_model_fits
from pipelines.engine.optimizers import SGD_MOMENTUM, build_optimizer
from pipelines.engine.run_history import check_resume, record_start
from pipelines.engine.run_log import RunLog
from pipelines.engine.worker_errors import USER_ERRORS, Carrying, raising

log = logging.getLogger(__name__)
# the fewest steps between validations at epoch ends (`eval_every` unset): a tiny set's epochs are shorter
EPOCH_EVAL_MIN_STEPS = 10

_TRAIN_STREAM, _VALID_STREAM, _STEP_STREAM = 0, 1, 2


@dataclass
class TrainConfig:
    """How to optimise; the task decides what. `batch_size` is global: examples per optimizer step over
    all workers and accumulation steps (a micro-batch holds batch_size / (workers x grad_accum))."""

    # the one place each setting's range is written; checked when a config is resolved (model.ranges)
    RANGES: ClassVar[dict[str, str]] = {
        "lr": "[0, 1000]",
        "momentum": "[0, 1)",
        "batch_size": "[1, 16777216]",
        "epochs": "[1, 1000000]",
        "max_steps": "[0, 1000000000]",
        "lr_steps": "[1, 1000000000]",
        "lr_gamma": "(0, 1]",
        "lr_decay_epochs": "[1, 1000000]",
        "warmup_ratio": "[0, 1]",
        "warmup_iters": "[0, 1000000000]",
        "warmup_factor": "[0, 1]",
        "weight_decay": "[0, 1]",
        "clip_norm": "> 0",
        "clip_value": "> 0",
        "grad_accum": "[1, 65536]",
        "save_every": "[1, 1000000000]",
        "keep_checkpoints": "[1, 1000000]",
        "log_every": "[1, 1000000000]",
        "eval_every": "[1, 1000000000]",
        "eval_batch_size": "[1, 16777216]",
        "seed": "[0, 4294967295]",
        "loader_workers": "[0, 1024]",
        "device": "device",
        "workers": "[0, 65536]",
        "gpus_per_worker": "[0, 64]",
        "cpus_per_worker": "[0, 1024]",
        "max_failures": "[-1, 1000000]",
    }

    lr: float = 1e-4
    # bertadam: the LXMERT release's BertAdam (no bias correction, eps 1e-6); adamw: torch's AdamW;
    # sgd: torch's SGD with `momentum` and L2 weight decay (detectron2's solver)
    optimizer: Literal["adamw", "bertadam", "sgd"] = "adamw"
    momentum: float = SGD_MOMENTUM  # sgd only
    batch_size: int = 32
    epochs: int = 1
    max_steps: int | None = None  # when set, wins over epochs
    # linear: warm-up, then linear decay to 0 at the last step (the release's warm-up-linear);
    # steps: warm-up, then lr x lr_gamma^(lr_steps passed) (detectron2's WarmupMultiStepLR);
    # epochs: warm-up, then lr x lr_gamma^(epoch // lr_decay_epochs) (self-critical.pytorch's step decay)
    schedule: Literal["linear", "steps", "epochs"] = "linear"
    # absolute step numbers s: updates s+1, s+2, ... (detectron2's iterations s, s+1, ...) use the lowered
    # rate; empty = constant after the warm-up
    lr_steps: list[int] = field(default_factory=list)
    lr_gamma: float = 0.1
    lr_decay_epochs: int = 3  # schedule=epochs: epochs between two decays
    warmup_ratio: float = 0.05
    warmup_iters: int | None = None  # warm-up steps; when set, wins over warmup_ratio
    # the warm-up's first rate as a fraction of lr, rising linearly to 1 (detectron2's WARMUP_FACTOR);
    # 0 = step / warm-up steps
    warmup_factor: float = 0.0
    weight_decay: float = 0.01
    decay_norm_and_bias: bool = True  # the release's BertAdam decays every parameter; False skips 1-d ones
    clip_norm: float | None = 1.0
    clip_value: float | None = None  # clamp every gradient element to ±clip_value (after clip_norm if any)
    grad_accum: int = 1
    amp: Literal["auto", "none", "bf16", "fp16"] = "auto"  # autocast on CUDA only; auto = bf16 if supported
    # CUDA float32 matmuls and convolutions (those autocast leaves in float32, or all with amp=none) in
    # TF32: faster on Ampere and later, ~1e-3 relative error; false = IEEE float32
    tf32: bool = False
    # the training step (forward and backward) through torch.compile: auto = on for CUDA, off elsewhere;
    # reduce-overhead = on, replayed as CUDA graphs on CUDA (plain compiling elsewhere); a model that
    # cannot compile trains on eagerly after one warning line
    compile: Literal["auto", "on", "off", "reduce-overhead"] = "auto"
    save_every: int | None = None  # steps between checkpoints; one is always written at the end
    keep_checkpoints: int | None = None  # keep only the newest K step directories
    log_every: int = 10
    progress: Literal["auto", "bar", "log"] = "auto"  # auto: a bar on a terminal, else plain log lines
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])  # + mlflow, wandb (when installed)
    # steps between validations; None = at each epoch end, but on a tiny set (epochs of fewer than
    # EPOCH_EVAL_MIN_STEPS steps) every few epochs, so that validating does not outweigh training
    eval_every: int | None = None
    eval_batch_size: int | None = None  # None = the micro-batch size
    seed: int = 0
    loader_workers: int = 2
    device: str = "auto"  # auto = this worker's GPU if any, else cpu
    workers: int = 0  # 0 = train in this process (or under torchrun); N = N Ray Train workers
    gpus_per_worker: float | None = None  # None = 1 when the Ray cluster has GPUs, else CPU workers
    cpus_per_worker: float = 1.0
    ray_address: str | None = None  # None = a private local Ray instance (or RAY_ADDRESS when set)
    # Ray Train restarts the worker group from the last checkpoint this many times after a lost worker or
    # node (-1: without limit); a deterministic error is retried as often, so keep it small
    max_failures: int = 2
    # where Ray Train keeps the run's checkpoints (a folder every node reaches, or a URI such as s3://...);
    # None = the run directory itself (its checkpoints/ folder, no copy)
    storage_path: str | None = None

    def __post_init__(self) -> None:
        # a config built in code meets the same ranges as one read from YAML or KEY=VALUE
        check_fields(self, "train settings", "train.")
        steps = self.lr_steps
        if any(s <= 0 for s in steps) or list(steps) != sorted(set(steps)):
            raise ValueError(f"train.lr_steps must be positive, increasing step numbers; got {steps}")


class NonFiniteLoss(ValueError):
    """The loss went NaN or infinite: the run stops (exit 1) with the step, the terms and the checkpoint."""


class RunStopped(ValueError):
    """A worker of a distributed run met bad input (this worker or another): all stop with its line."""


class Task(Protocol):
    """What `fit` trains. Batches are dicts; tensors in them are moved to the device by the loop.

    `loss` returns the total and its named terms, floats or 0-dim tensors: tensors stay on the device until
    a logged step reads them all at once, so a step that returns tensors never waits for the device.

    Optional: `config` (a dataclass written into config.yaml), `set_epoch(epoch)` (called before each
    epoch's batches, in every worker, e.g. for schedules that switch a loss on) and
    `init_trainer_states()` (trainer states whose optimizer a new run continues: the first whose model is
    the one `build_model` gave)."""

    primary_metric: str | None  # validation key for best/ (higher is better); None = no best/

    def build_model(self) -> torch.nn.Module: ...

    def train_dataset(self) -> Dataset: ...

    def valid_dataset(self) -> Dataset | None: ...

    def collate(self, items: list, rng: np.random.Generator) -> dict: ...

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, Any]]: ...

    def evaluate(self, model: torch.nn.Module, loader: Any) -> dict[str, float]: ...

    def save(self, model: torch.nn.Module, directory: Path) -> None: ...


class Reporter(Protocol):
    """Told on every worker, at the same steps, what the run logged and the checkpoint directory written
    at this step (rank 0 wrote it; None when none was): the hook Ray Train's `ray.train.report` hangs on."""

    def __call__(self, step: int, metrics: dict[str, float], checkpoint: Path | None) -> None: ...


class BatchDataset(Dataset):
    """Micro-batch g of a pass: its examples and its collation RNG follow from (key, g) alone, so any
    number of loader workers, and a resumed run, produce the very same batches."""

    def __init__(self, dataset: Dataset, collate, order: np.ndarray, micro_batch: int, key: tuple[int, ...]):
        self.dataset, self.collate, self.order = dataset, collate, order
        self.micro_batch, self.key = micro_batch, key

    def __len__(self) -> int:
        return math.ceil(len(self.order) / self.micro_batch)

    def __getitem__(self, g: int) -> dict:
        self._ask_ahead(g)
        ids = [int(i) for i in self.order[g * self.micro_batch : (g + 1) * self.micro_batch]]
        # a dataset that reads a whole micro-batch at once (one store transaction, columns instead of
        # per-example dicts) says so the way torch's DataLoader expects: `__getitems__`
        take = getattr(self.dataset, "__getitems__", None)
        items = take(ids) if take is not None else [self.dataset[i] for i in ids]
        batch = self.collate(items, np.random.default_rng([*self.key, g]))
        return for_transfer(batch) if get_worker_info() is not None else batch

    def _ask_ahead(self, g: int) -> None:
        """Ask the dataset's store for the batch this process reads after g (a loader worker is handed
        every n-th batch of the pass, n the number of workers), so the disk reads it while batch g is read,
        collated and used: the two overlap where a cold store would have them take turns."""
        ahead = getattr(self.dataset, "request_ahead", None)
        if ahead is None:
            return
        info = get_worker_info()
        after = g + (info.num_workers if info is not None else 1)
        if after < len(self):
            ahead([int(i) for i in self.order[after * self.micro_batch : (after + 1) * self.micro_batch]])


def validation_interval(steps_per_epoch: int) -> int:
    """Steps between validations when `eval_every` is not set: every epoch's end, or every few epochs'
    when an epoch has fewer than EPOCH_EVAL_MIN_STEPS steps (15 pictures in batches of 32 make epochs of
    one step: validating each would decode the validation set after every step)."""
    epochs = max(1, -(-EPOCH_EVAL_MIN_STEPS // max(1, steps_per_epoch)))
    if epochs > 1:
        log.info(
            "epochs of %d steps: validating every %d epochs (%d steps; train.eval_every=N to choose)",
            steps_per_epoch,
            epochs,
            epochs * steps_per_epoch,
        )
    return epochs * steps_per_epoch


class TrainingRun:
    """One worker's run: build, restore, the loop with its optimizer steps, validation and checkpoints."""

    def __init__(
        self,
        task: Task,
        cfg: TrainConfig,
        out_dir: Path,
        resume: bool,
        reporter: Reporter | None = None,
        restore_from: Path | None = None,
    ):
        """`restore_from`: a checkpoint directory to resume from instead of the run's newest (Ray Train's
        own record of the last reported checkpoint, after a restart)."""
        dist = torch.distributed
        self.task, self.cfg, self.out_dir = task, cfg, out_dir
        self.distributed = dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.is_main = self.rank == 0
        self.device = pick_device(cfg.device)
        self.amp_dtype = _amp_dtype(cfg.amp, self.device)
        if cfg.batch_size % (self.world * cfg.grad_accum):
            raise ValueError(
                f"--batch-size {cfg.batch_size} is not divisible by workers x grad_accum = "
                f"{self.world} x {cfg.grad_accum}; change one of them"
            )
        self.micro_batch = cfg.batch_size // (self.world * cfg.grad_accum)
        self.resume = resume or restore_from is not None
        self.restore_from = restore_from
        self.reporter = reporter
        self.ckpt_root = out_dir / CHECKPOINTS
        self.run_log = RunLog(out_dir, enabled=self.is_main, trackers=cfg.trackers, progress=cfg.progress)

    # ---- setup
    def _build(self) -> None:
        cfg = self.cfg
        self.train_set = self.task.train_dataset()
        self.valid_set = self.task.valid_dataset()
        self.steps_per_epoch = len(self.train_set) // cfg.batch_size
        self.eval_interval = cfg.eval_every or validation_interval(self.steps_per_epoch)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training set has {len(self.train_set)} examples, fewer than one batch "
                f"(--batch-size {cfg.batch_size}); lower --batch-size (train.batch_size)"
            )
        self.total_steps = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * self.steps_per_epoch
        torch.manual_seed(cfg.seed)
        if not getattr(getattr(self.task, "config", None), "init", None):  # a checkpoint's size is its own
            check_model_fits(self.task.build_model, cfg.optimizer, cfg.momentum, self.device)
            torch.manual_seed(cfg.seed)  # building on the meta device may have drawn numbers
        self.model = self.task.build_model().to(self.device)
        self.optimizer = build_optimizer(
            cfg.optimizer,
            _param_groups(self.model, cfg),
            cfg.lr,
            cfg.weight_decay,
            momentum=cfg.momentum,
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _schedule(cfg, self.total_steps, self.steps_per_epoch)
        )
        self.scaler = torch.amp.GradScaler("cuda") if self.amp_dtype == torch.float16 else None
        self.step = 0
        # the losses of the steps since the last logged row: saved with a checkpoint, so a resumed run logs
        # the same means as one that never stopped
        self.window: dict[str, list[float]] = {}
        # the steps since then whose terms are still on the device: (step, terms), read at the next settle
        self.pending: list[tuple[int, dict[str, Any]]] = []
        self.best: dict | None = None
        # the step this run's count started from: the --init run's last, when it continues that run
        self.start_step = 0
        self.last_train: dict = {}
        self.last_valid: dict = {}

    def _restore(self) -> None:
        latest = self.restore_from or latest_checkpoint(self.ckpt_root)
        if not self.resume:
            if latest is not None:
                raise FileExistsError(
                    f"{self.out_dir} already holds a run (checkpoint {latest.name}); pass --resume to "
                    "continue it or choose another output directory"
                )
            self._continue_optimizer()
            return
        if latest is None:
            log.warning("resume requested but %s holds no checkpoint: starting from step 0", self.ckpt_root)
            return
        check_resume(self.out_dir, run_config(self.task, self.cfg))
        state = read_state(latest / STATE_FILE, self.device)
        if state["micro_batch"] * state["world"] * state["grad_accum"] != self.cfg.batch_size:
            raise ValueError(
                f"{latest}: saved with batch_size {state['batch_size']}, now {self.cfg.batch_size}"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # the schedule is this run's: resumed with more (or fewer) steps, the rate decays over the new total
        # from here instead of going on at the saved rate (0 where the old schedule had ended)
        self.start_step = int(state.get("start_step", 0))
        self.total_steps += self.start_step
        for group, base, schedule in zip(
            self.optimizer.param_groups, self.scheduler.base_lrs, self.scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base * schedule(int(state["step"]) - self.start_step)
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.best = json.loads(state["best"]) if state.get("best") else None
        self.window = json.loads(state["window"]) if state.get("window") else {}
        log.info("resumed from %s at step %d", latest, self.step)

    def _continue_optimizer(self) -> None:
        """The optimizer state (Adam's moments and step counts) saved with the weights the model starts
        from, where the task asks for it, as self-critical.pytorch's --start_from continues optimizer.pth;
        this run's own rates, settings and schedule apply from its first step. Like --start_from, the run
        also goes on counting from the earlier run's step (validation every `eval_every` steps of the whole
        count, checkpoints step-N after the earlier ones) and keeps its best score: `best/` is written when
        this run beats it."""
        candidates = getattr(self.task, "init_trainer_states", lambda: [])()
        if not candidates:
            return
        own = self.model.state_dict()
        for path in candidates:
            state = read_state(path, self.device)
            saved = state["model"]
            if saved.keys() == own.keys() and all(torch.equal(saved[k], v) for k, v in own.items()):
                break
        else:
            raise ValueError(
                f"none of {', '.join(map(str, candidates))} holds the optimizer of the --init weights (their "
                "models differ); give the checkpoint directory itself as --init"
            )
        fresh = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except ValueError as exc:
            raise ValueError(f"{path}: its optimizer state does not fit this run's ({exc})") from exc
        for group, settings in zip(self.optimizer.param_groups, fresh, strict=True):
            group.update(settings)
        self.start_step = int(state["step"])
        self.step = self.start_step
        self.total_steps += self.start_step
        prior = json.loads(state["best"]) if state.get("best") else None
        if prior is not None and prior.get("metric") == self.task.primary_metric:
            self.best = prior
        log.info(
            "continuing the optimizer state, the step count and the best score (%s) of %s (step %d)",
            "none" if self.best is None else f"{self.best['metric']} {self.best['value']:.4g}",
            path.parent,
            self.start_step,
        )

    # ---- loop
    def train(self) -> dict:
        """Run to the last step; CUDA float32 work (validation included) uses TF32 only if `tf32` says."""
        with float32_precision(self.cfg.tf32):
            return self._train()

    def _train(self) -> dict:
        cfg = self.cfg
        self._build()
        self._restore()
        if self.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            config = run_config(self.task, self.cfg)
            record_start(self.out_dir, config, self.step)
            self.run_log.open(self.step, self.total_steps, config)
        model = self.model
        if self.distributed:
            model = torch.nn.parallel.DistributedDataParallel(
                self.model,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=True,  # switched-off tasks leave their heads without gradients
            )
        self.stepped = model  # what the task's loss calls: the model, or DDP around it
        self.compiled = None
        self.cuda_graphs = False
        if wants_compile(cfg.compile, self.device):
            log.info("train.compile: the step is compiled at its first call (torch.compile)")
            mode = compile_mode(cfg.compile, self.device)
            self.cuda_graphs = mode == CUDA_GRAPHS
            self.compiled = compile_model(model, mode)
        window = self.window
        tick, samples = time.perf_counter(), 0
        while self.step < self.total_steps:
            epoch, first = divmod(self.step, self.steps_per_epoch)
            if hasattr(self.task, "set_epoch"):
                self.task.set_epoch(epoch)
            batches = self._train_batches(epoch, first)
            model.train()
            for _ in range(first, self.steps_per_epoch):
                if self.step >= self.total_steps:
                    break
                logged = False
                lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
                self.pending.append((self.step + 1, self._optimizer_step(batches)))
                samples += cfg.batch_size
                self.step += 1
                self.run_log.advance(self.step)
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    self._settle()
                    now = time.perf_counter()
                    row = {"step": self.step, "epoch": epoch, "lr": lr}
                    row.update({k: float(np.mean(v)) for k, v in window.items()})
                    row["samples_per_s"] = samples / max(now - tick, 1e-9)
                    self.last_train = row
                    self._log(row)
                    window.clear()
                    tick, samples = now, 0
                    logged = True
                due_eval = self.step % self.eval_interval == 0
                if due_eval or self.step == self.total_steps:
                    self._validate(epoch)
                    model.train()
                saved = None
                if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == self.total_steps:
                    saved = self._save_checkpoint()
                if self.reporter is not None and (logged or saved is not None):
                    metrics = {**self.last_valid, **self.last_train, "step": self.step}
                    self.reporter(self.step, metrics, saved)
            del batches
        summary = {
            "step": self.step,
            "train": self.last_train,
            "valid": self.last_valid,
            "best": self.best,
            "out_dir": str(self.out_dir),
        }
        if self.is_main:
            replace_dir(self.out_dir / "last", lambda d: self.task.save(self.model, d))
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            self.run_log.curves()
            self.run_log.close()
        if self.distributed:
            torch.distributed.barrier()
        return summary

    def _train_batches(self, epoch: int, first_step: int) -> Iterator[dict]:
        cfg = self.cfg
        order = np.random.default_rng([cfg.seed, _TRAIN_STREAM, epoch]).permutation(len(self.train_set))
        data = BatchDataset(
            self.train_set, self.task.collate, order, self.micro_batch, (cfg.seed, _TRAIN_STREAM, epoch)
        )
        # this worker's micro-batches: step s, accumulation a -> global micro index (s*accum+a)*world+rank
        mine = [
            (s * cfg.grad_accum + a) * self.world + self.rank
            for s in range(first_step, self.steps_per_epoch)
            for a in range(cfg.grad_accum)
        ]
        # the loader's iterator is made here, not at the first batch: making it draws from torch's RNG
        return raising(iter(self._loader(Carrying(data), mine)))

    def _loader(self, data: Dataset, indices: list[int]) -> DataLoader:
        workers = self.cfg.loader_workers
        return DataLoader(
            data,
            batch_size=None,
            sampler=indices,
            num_workers=workers,
            pin_memory=self.device.type == "cuda",
            persistent_workers=False,
            prefetch_factor=4 if workers > 0 else None,
        )

    def _non_finite(self, step: int, parts: dict[str, float]) -> str:
        """One line: the step, the loss terms that went non-finite, the last good checkpoint."""
        terms = [f"{k}={v}" for k, v in parts.items() if k != "loss" and not math.isfinite(v)]
        latest = latest_checkpoint(self.ckpt_root)
        resume = (
            f"the last good checkpoint is {latest}" if latest is not None else "no checkpoint was written"
        )
        return (
            f"loss is {parts['loss']} at step {step} ({', '.join(terms) or 'the total only'}); "
            f"{resume}; lower train.lr or check the data"
        )

    def _settle(self) -> None:
        """Read the pending steps' loss terms off the device in one transfer into the logged window; a
        non-finite loss stops the run (every worker, in a distributed one) with the first such step's line.
        Called where the loop logs or checkpoints, never inside a step."""
        tensors = [v for _, parts in self.pending for v in parts.values() if isinstance(v, torch.Tensor)]
        values = iter(
            torch.stack([t.float().reshape(()).to(self.device) for t in tensors]).tolist() if tensors else []
        )
        error: BaseException | None = None
        for step, parts in self.pending:
            floats = {k: next(values) if isinstance(v, torch.Tensor) else float(v) for k, v in parts.items()}
            if error is None and not math.isfinite(floats["loss"]):
                error = NonFiniteLoss(self._non_finite(step, floats))
            if error is None:
                for k, v in floats.items():
                    self.window.setdefault(k, []).append(v)
        self.pending.clear()
        if self.distributed:
            self._agree(error)
        elif error is not None:
            raise error

    def _micro_loss(self, model: torch.nn.Module, batches: Iterator[dict]) -> tuple[torch.Tensor, dict]:
        """The next micro-batch's loss. A worker that meets bad data stops every worker at the same
        micro-batch with its one line (`RunStopped`), before the gradients' all-reduce, which would
        otherwise wait for it forever."""
        error: BaseException | None = None
        try:
            batch = to_device(next(batches), self.device)
            if self.cuda_graphs and model is self.compiled:
                # a new replay may reuse the last one's outputs: the step's terms were copied out already
                torch.compiler.cudagraph_mark_step_begin()
            with self._autocast():
                loss, parts = self.task.loss(model, batch)
        except USER_ERRORS as exc:
            if not self.distributed:
                raise
            error = exc
        if self.distributed:
            self._agree(error)
        return loss, parts

    def _agree(self, error: BaseException | None) -> None:
        """Every worker learns whether any failed; if one did, each raises the lowest failed rank's line."""
        dist = torch.distributed
        failed = torch.tensor([0 if error is None else 1], device=self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if not int(failed.item()):
            return
        lines: list[str | None] = [None] * self.world
        dist.all_gather_object(lines, None if error is None else str(error))
        raise RunStopped(next(line for line in lines if line is not None)) from error

    def _optimizer_step(self, batches: Iterator[dict]) -> dict[str, Any]:
        """One update; returns the step's loss terms (means over its micro-batches), tensors left on the
        device. A compiled step that fails is run again eagerly on the same micro-batches, and every later
        step is eager."""
        if self.compiled is None:
            parts = self._accumulate(self.stepped, batches)
        else:
            seen: list[dict] = []
            try:
                with static_layout():  # padded rows: shapes from the batch size alone, no host sync
                    parts = self._accumulate(self.compiled, _recording(batches, seen))
            except USER_ERRORS:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure to compile or run compiled code
                log.warning("%s", failure_line(exc))
                self.compiled = None
                self.optimizer.zero_grad(set_to_none=True)
                parts = self._accumulate(self.stepped, itertools.chain(seen, batches))
        cfg = self.cfg
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if cfg.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_norm)
        if cfg.clip_value:
            torch.nn.utils.clip_grad_value_(self.model.parameters(), cfg.clip_value)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return parts

    def _accumulate(self, model: torch.nn.Module, batches: Iterator[dict]) -> dict[str, Any]:
        """Forward and backward over the step's micro-batches; their loss terms, summed on the device."""
        cfg = self.cfg
        seed = np.random.SeedSequence([cfg.seed, _STEP_STREAM, self.step, self.rank]).generate_state(1)[0]
        torch.manual_seed(int(seed))  # dropout of step s is the same whether or not the run was resumed
        parts_sum: dict[str, Any] = {}
        for a in range(cfg.grad_accum):
            sync = a == cfg.grad_accum - 1 or not self.distributed
            with contextlib.nullcontext() if sync else model.no_sync():
                loss, parts = self._micro_loss(model, batches)
            scaled = loss / cfg.grad_accum
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            for k, v in {"loss": loss, **parts}.items():
                v = v.detach() if isinstance(v, torch.Tensor) else float(v)
                parts_sum[k] = parts_sum.get(k, 0.0) + v / cfg.grad_accum
        return parts_sum

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.amp_dtype)

    # ---- validation, checkpoints, logs
    def _validate(self, epoch: int) -> None:
        if self.valid_set is None or len(self.valid_set) == 0:
            return
        if self.is_main:
            cfg = self.cfg
            size = cfg.eval_batch_size or self.micro_batch
            order = np.arange(len(self.valid_set))
            data = BatchDataset(self.valid_set, self.task.collate, order, size, (cfg.seed, _VALID_STREAM))
            loader = self._loader(data, list(range(len(data))))
            self.model.eval()
            with torch.no_grad(), self._autocast():
                metrics = self.task.evaluate(self.model, (to_device(b, self.device) for b in loader))
            row = {"step": self.step, "epoch": epoch, **{f"valid_{k}": float(v) for k, v in metrics.items()}}
            self.last_valid = row
            self._log(row)
            metric = self.task.primary_metric
            if metric is not None:
                if metric not in metrics:
                    raise KeyError(
                        f"evaluate() returned {sorted(metrics)} without the primary metric {metric!r}"
                    )
                if self.best is None or metrics[metric] > self.best["value"]:
                    self.best = {"step": self.step, "metric": metric, "value": float(metrics[metric])}
                    replace_dir(self.out_dir / "best", lambda d: self.task.save(self.model, d))
                    (self.out_dir / "best" / "best.json").write_text(json.dumps({**self.best, "valid": row}))
        if self.distributed:
            torch.distributed.barrier()

    def _save_checkpoint(self) -> Path:
        """Write checkpoints/step-N (rank 0) and return it; every worker returns once it is complete."""
        self._settle()  # a checkpoint holds the logged window, and only steps of finite loss
        target = step_dir(self.ckpt_root, self.step)
        if self.is_main:

            def write(d: Path) -> None:
                self.task.save(self.model, d)
                state = {
                    "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "scaler": self.scaler.state_dict() if self.scaler is not None else {},
                    "step": self.step,
                    "start_step": self.start_step,
                    "best": json.dumps(self.best) if self.best else "",
                    "window": json.dumps(self.window),
                    "batch_size": self.cfg.batch_size,
                    "micro_batch": self.micro_batch,
                    "world": self.world,
                    "grad_accum": self.cfg.grad_accum,
                }
                torch.save(state, d / STATE_FILE)

            replace_dir(target, write)
            if self.cfg.keep_checkpoints:
                prune(self.ckpt_root, self.cfg.keep_checkpoints)
            self.run_log.curves()
            log.info("checkpoint %s", target)
        if self.distributed:
            torch.distributed.barrier()
        return target

    def _log(self, row: dict) -> None:
        self.run_log.log(row)


def run_config(task: Task, cfg: TrainConfig) -> dict[str, Any]:
    """The run's settings as config.yaml holds them: `train:` and, when the task has a dataclass
    `config`, `task:`."""
    data: dict[str, Any] = {"train": config_io.to_dict(cfg)}
    task_cfg = getattr(task, "config", None)
    if task_cfg is not None and dataclasses.is_dataclass(task_cfg):
        data["task"] = config_io.to_dict(task_cfg)
    return data


def _recording(batches: Iterator[dict], seen: list[dict]) -> Iterator[dict]:
    """`batches`, each one also appended to `seen` (to run a step's micro-batches again)."""
    for batch in batches:
        seen.append(batch)
        yield batch


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device`; other values pass through."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    if device.type != "cuda" or amp == "none":
        if amp in ("bf16", "fp16") and device.type != "cuda":
            log.warning("amp=%s is for CUDA; training in float32 on %s", amp, device)
        return None
    if amp == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]


def _param_groups(model: torch.nn.Module, cfg: TrainConfig) -> list[dict]:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if cfg.decay_norm_and_bias:
        return [{"params": [p for _, p in params], "weight_decay": cfg.weight_decay}]
    return [
        {"params": [p for _, p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def _schedule(cfg: TrainConfig, total: int, steps_per_epoch: int = 1):
    """The factor on lr for the update after `step` updates, as `cfg.schedule` says."""
    # a fraction of the run, not truncated: the release's BertAdam warms up over warmup x t_total steps
    warmup = cfg.warmup_iters if cfg.warmup_iters is not None else cfg.warmup_ratio * total
    if cfg.schedule == "steps":
        late = [s for s in cfg.lr_steps if s >= total]
        if late:
            log.warning("train.lr_steps %s are not below the %d steps of this run: ignored", late, total)
        return _step_schedule(warmup, cfg.lr_steps, cfg.lr_gamma, cfg.warmup_factor)
    if cfg.lr_steps:
        raise ValueError(
            f"train.lr_steps {cfg.lr_steps} apply to train.schedule=steps, not {cfg.schedule!r}; "
            "set train.schedule=steps or train.lr_steps=[]"
        )
    if cfg.schedule == "epochs":
        every = cfg.lr_decay_epochs * steps_per_epoch  # updates between two decays
        return _step_schedule(warmup, list(range(every, total, every)), cfg.lr_gamma, cfg.warmup_factor)
    ratio = cfg.warmup_iters / total if cfg.warmup_iters is not None else cfg.warmup_ratio
    return _linear_schedule(ratio, total, cfg.warmup_factor)


def _warmup(alpha: float, start: float) -> float:
    """The warm-up's factor at the fraction `alpha` of it, rising linearly from `start` to 1."""
    return start * (1 - alpha) + alpha  # start 0 gives alpha exactly


def _linear_schedule(ratio: float, total: int, warmup_factor: float = 0.0):
    """The release's warmup_linear of the progress x = step / total, written as it computes it (so the
    rates have its bits): x / ratio during the warm-up, then (x - 1) / (ratio - 1) down to 0."""

    def factor(step: int) -> float:
        x = step / total
        if x < ratio:
            return _warmup(x / ratio, warmup_factor)
        return max((x - 1.0) / (ratio - 1.0), 0.0) if ratio < 1 else 0.0

    return factor


def _step_schedule(warmup: float, steps: list[int], gamma: float, warmup_factor: float):
    milestones = list(steps)

    def factor(step: int) -> float:
        rise = _warmup(step / warmup, warmup_factor) if step < warmup else 1.0
        return rise * gamma ** bisect.bisect_right(milestones, step)

    return factor
