"""Ray Train fault tolerance: a worker killed with SIGKILL, the run resumes from its newest checkpoint on its
own (Ray's last reported one, or the run's own step-N while Ray holds none) and ends with the weights of an
uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipelines.engine import launch
from pipelines.engine.launch import fit
from pipelines.engine.run_history import HISTORY_FILE
from pipelines.engine.run_log import read_metrics
from pipelines.engine.trainer import TrainConfig

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer import ToyTask  # noqa: E402

pytestmark = pytest.mark.slow


class KilledOnce(ToyTask):
    """The toy task; rank 1 stops in the loss of its `at`-th step of the first attempt and waits there to
    be killed. Each worker process writes the epochs it starts into `marks`, so the test sees restarts."""

    def __init__(self, marks: Path, at: int | None):
        self.marks, self.at, self.calls = str(marks), at, 0

    def set_epoch(self, epoch: int) -> None:
        with open(Path(self.marks) / f"epochs-{os.getpid()}", "a") as f:
            f.write(f"{epoch}\n")

    def loss(self, model, batch):
        self.calls += 1
        victim = Path(self.marks) / "victim"
        if self.at and self.calls == self.at and torch.distributed.get_rank() == 1 and not victim.exists():
            # written whole, then renamed: the killer polls for the name and must never read it half-written
            partial = victim.with_name("victim.tmp")
            partial.write_text(str(os.getpid()))
            partial.replace(victim)
            time.sleep(120)  # killed long before; were it not, the test fails on the missing restart
        return super().loss(model, batch)


class KilledAt(ToyTask):
    """The toy task; rank 1 of the k-th attempt waits to be killed at the k-th of `kills`: ("loss", n) in the
    loss of the attempt's n-th step, ("report", s) with checkpoints/step-s written but before reporting it
    to Ray. It writes `marks`/victim-k with its pid, for the killer."""

    def __init__(self, marks: Path, kills: tuple[tuple[str, int], ...]):
        self.marks, self.kills, self.calls = str(marks), kills, 0

    def train_dataset(self):
        # in the worker process, before the loop: the reporter pauses there too (patched once per process)
        if not getattr(launch.RayReporter.__call__, "pauses", False):
            original = launch.RayReporter.__call__

            def call(reporter, step, metrics, checkpoint):
                if checkpoint is not None:
                    self._maybe_wait("report", step)
                original(reporter, step, metrics, checkpoint)

            call.pauses = True
            launch.RayReporter.__call__ = call
        return super().train_dataset()

    def loss(self, model, batch):
        self.calls += 1
        self._maybe_wait("loss", self.calls)
        return super().loss(model, batch)

    def _maybe_wait(self, where: str, at: int) -> None:
        marks = Path(self.marks)
        attempt = len(list(marks.glob("victim-*"))) + 1
        due = self.kills[attempt - 1] if attempt <= len(self.kills) else None
        if torch.distributed.get_rank() != 1 or due != (where, at):
            return
        partial = marks / "victim.tmp"
        partial.write_text(str(os.getpid()))
        partial.replace(marks / f"victim-{attempt}")
        time.sleep(120)


def _cfg(**kw) -> TrainConfig:
    base = dict(
        lr=0.02,
        batch_size=8,
        epochs=3,  # 8 steps per epoch, 24 in all
        warmup_ratio=0.1,
        log_every=4,
        loader_workers=0,
        seed=3,
        save_every=5,
        workers=2,
        cpus_per_worker=1.0,
        max_failures=1,
        trackers=[],
        progress="log",
    )
    base.update(kw)
    return TrainConfig(**base)


def _kill_when_ready(victim: Path, killed: list[int]) -> threading.Thread:
    def kill() -> None:
        deadline = time.monotonic() + 90
        while not victim.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if victim.exists():
            pid = int(victim.read_text())
            os.kill(pid, signal.SIGKILL)  # a worker lost as a node would lose it: no cleanup, no exception
            killed.append(pid)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def ray_for_module():
    """One private local Ray instance with 2 CPUs for this module's runs, shut down afterwards."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def straight(ray_for_module, tmp_path_factory) -> Path:
    """The uninterrupted run both killed runs must end equal to (a minute of Ray on 2 cores: run once)."""
    root = tmp_path_factory.mktemp("straight")
    (root / "marks").mkdir()
    fit(KilledOnce(root / "marks", at=None), _cfg(), root / "run")
    return root / "run"


def _same_run(straight: Path, run: Path) -> None:
    """The same final weights, bit for bit, and the same logged losses, each step logged once."""
    a = torch.load(straight / "last" / "toy.pt", weights_only=True)
    b = torch.load(run / "last" / "toy.pt", weights_only=True)
    start = ToyTask().build_model()
    assert any(not torch.allclose(a[k], v) for k, v in start.state_dict().items() if "weight" in k)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(4, 25, 4)), "each step logged once"
    reference = {r["step"]: r["loss"] for r in read_metrics(straight / "metrics.jsonl") if "loss" in r}
    assert {r["step"]: r["loss"] for r in rows} == reference


def test_a_killed_worker_resumes_from_the_last_checkpoint_and_ends_as_if_uninterrupted(tmp_path, straight):
    killed_run, marks_b = tmp_path / "killed", tmp_path / "marks-b"
    marks_b.mkdir()

    killed: list[int] = []
    killer = _kill_when_ready(marks_b / "victim", killed)
    # this run keeps Ray's copy of each checkpoint elsewhere, as on a cluster with a shared bucket
    storage = tmp_path / "storage"
    cfg = _cfg(storage_path=str(storage), keep_checkpoints=2)
    summary = fit(KilledOnce(marks_b, at=13), cfg, killed_run)  # step 13: after the step-10 checkpoint
    killer.join(timeout=1)
    assert killed, "rank 1 never reached the step it was to be killed in"
    assert summary["step"] == 24

    # two workers started twice; the second pair started in epoch 1 (step 10), not from the beginning
    starts = {p.name: p.read_text().split() for p in marks_b.glob("epochs-*")}
    assert len(starts) == 4 and f"epochs-{killed[0]}" in starts
    assert sorted(first[0] for first in starts.values()) == ["0", "0", "1", "1"]

    _same_run(straight, killed_run)  # step 12 is logged once, not twice
    # Ray's own record of each run: the reported checkpoints, in place in the run directory by default
    snapshot = (straight / "checkpoints" / "checkpoint_manager_snapshot.json").read_text()
    assert "step-24" in snapshot and (straight / "checkpoints" / "step-24" / "toy.pt").is_file()
    (ray_run,) = storage.iterdir()
    assert ray_run.name.startswith("killed-"), "a name of its own per run directory"
    assert sorted(p.name for p in ray_run.glob("step-*")) == ["step-20", "step-24"], "num_to_keep=2"
    assert torch.equal(
        torch.load(ray_run / "step-24" / "toy.pt", weights_only=True)["0.weight"],
        torch.load(killed_run / "last" / "toy.pt", weights_only=True)["0.weight"],
    )


def test_a_restart_resumes_whenever_the_worker_is_lost_and_ends_as_if_uninterrupted(tmp_path, straight):
    """Three kills in one run (in place, Ray's default): before the first report (the restart starts
    afresh); with checkpoints/step-5 written but not yet reported, so Ray holds no checkpoint (the restart
    goes on from the run's own step-5, where it used to refuse the directory as another run's); mid-epoch
    after step-10 was reported (from step-10)."""
    run, marks = tmp_path / "run", tmp_path / "marks"
    marks.mkdir()
    # the third attempt resumes at step 5: its 8th step is step 13
    kills = (("loss", 2), ("report", 5), ("loss", 8))
    killed: list[int] = []
    killer = threading.Thread(target=_kill_each, args=(marks, len(kills), killed), daemon=True)
    killer.start()
    summary = fit(KilledAt(marks, kills), _cfg(max_failures=len(kills)), run)
    killer.join(timeout=1)
    assert len(killed) == len(kills), f"killed {len(killed)} of {len(kills)} workers"
    assert summary["step"] == 24

    starts = [json.loads(line) for line in (run / HISTORY_FILE).read_text().splitlines()]
    # the first attempt's start is dropped: the second began the run afresh
    assert [(s["start"], s["step"]) for s in starts] == [("new", 0), ("resume", 5), ("resume", 10)]
    _same_run(straight, run)

    # a fresh start into the directory is still refused: a restart is a resume of this run only
    with pytest.raises(FileExistsError, match="pass --resume"):
        fit(ToyTask(), _cfg(), run)


def _kill_each(marks: Path, count: int, killed: list[int]) -> None:
    """SIGKILL the worker that wrote victim-1, then victim-2, ... (each within a restart's time)."""
    for k in range(1, count + 1):
        victim = marks / f"victim-{k}"
        deadline = time.monotonic() + 180
        while not victim.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not victim.exists():
            return
        pid = int(victim.read_text())
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)
