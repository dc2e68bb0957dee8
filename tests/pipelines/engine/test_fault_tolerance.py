"""Ray Train fault tolerance: a worker killed with SIGKILL mid-run, the run resumes from its last reported
checkpoint on its own and ends with the weights of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pipelines.engine.launch import fit
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


def test_a_killed_worker_resumes_from_the_last_checkpoint_and_ends_as_if_uninterrupted(
    tmp_path, ray_two_cpus
):
    straight, killed_run = tmp_path / "straight", tmp_path / "killed"
    marks_a, marks_b = tmp_path / "marks-a", tmp_path / "marks-b"
    marks_a.mkdir(), marks_b.mkdir()
    fit(KilledOnce(marks_a, at=None), _cfg(), straight)

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

    a = torch.load(straight / "last" / "toy.pt", weights_only=True)
    b = torch.load(killed_run / "last" / "toy.pt", weights_only=True)
    start = KilledOnce(marks_a, None).build_model()
    assert any(not torch.allclose(a[k], v) for k, v in start.state_dict().items() if "weight" in k)
    for k in a:
        assert torch.equal(a[k], b[k]), k

    rows = [r for r in read_metrics(killed_run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(4, 25, 4)), "step 12 is logged once, not twice"
    reference = {r["step"]: r["loss"] for r in read_metrics(straight / "metrics.jsonl") if "loss" in r}
    assert {r["step"]: r["loss"] for r in rows} == reference
    # Ray's own record of each run: the reported checkpoints, in place in the run directory by default
    snapshot = (straight / "checkpoints" / "checkpoint_manager_snapshot.json").read_text()
    assert "step-24" in snapshot and (straight / "checkpoints" / "step-24" / "toy.pt").is_file()
    (ray_run,) = storage.iterdir()
    assert ray_run.name.startswith("killed-"), "a name of its own per run directory"
    assert sorted(p.name for p in ray_run.glob("step-*")) == ["step-20", "step-24"], "num_to_keep=2"
    assert torch.equal(
        torch.load(ray_run / "step-24" / "toy.pt", weights_only=True)["0.weight"], b["0.weight"]
    )
