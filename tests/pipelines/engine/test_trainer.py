"""The generic training loop on a toy regression task: learning, schedules, checkpoints, exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from torch.utils.data import Dataset

from extraction.precision import tf32_flags
from pipelines.engine import trainer
from pipelines.engine.checkpoints import latest_checkpoint
from pipelines.engine.launch import fit
from pipelines.engine.run_log import read_metrics
from pipelines.engine.trainer import TrainConfig


class _Points(Dataset):
    def __init__(self, n: int, seed: int):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, 4)).astype(np.float32)
        self.y = (self.x @ np.array([1.0, -2.0, 0.5, 3.0], dtype=np.float32)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class ToyTask:
    """y = w.x with input noise drawn from the collation RNG and dropout: every random source is used."""

    primary_metric = "neg_mse"

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))

    def train_dataset(self) -> Dataset:
        return _Points(64, 0)

    def valid_dataset(self) -> Dataset:
        return _Points(16, 1)

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        x = np.stack([i[0] for i in items])
        noise = rng.normal(scale=0.01, size=x.shape).astype(np.float32)
        return {"x": torch.from_numpy(x + noise), "y": torch.tensor([i[1] for i in items])}

    def loss(self, model, batch):
        loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
        return loss, {"mse": loss.item()}

    def evaluate(self, model, loader):
        errs = [float(torch.nn.functional.mse_loss(model(b["x"]).squeeze(-1), b["y"])) for b in loader]
        return {"mse": float(np.mean(errs)), "neg_mse": -float(np.mean(errs))}

    def save(self, model, directory: Path) -> None:
        torch.save(model.state_dict(), directory / "toy.pt")


def _cfg(**kw) -> TrainConfig:
    base = dict(lr=0.02, batch_size=8, epochs=2, warmup_ratio=0.1, log_every=2, loader_workers=0, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    return torch.load(directory / "toy.pt", weights_only=True)


def test_fit_learns_and_writes_the_run_directory(tmp_path):
    summary = fit(ToyTask(), _cfg(epochs=6, save_every=16), tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    assert train[-1]["loss"] < 0.2 * train[0]["loss"]
    assert {"step", "loss", "mse", "lr"} <= set(train[0])
    assert any("valid_mse" in r for r in rows)
    steps = sorted(int(p.name[5:]) for p in (tmp_path / "checkpoints").iterdir())
    assert steps == [16, 32, 48]
    assert summary["step"] == 48 == json.loads((tmp_path / "summary.json").read_text())["step"]
    for d in ("last", "best"):
        assert (tmp_path / d / "toy.pt").is_file()
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert "train" in (tmp_path / "config.yaml").read_text()


def test_schedule_warms_up_then_decays_to_zero(tmp_path):
    fit(ToyTask(), _cfg(epochs=5, log_every=1, warmup_ratio=0.2), tmp_path)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl") if "lr" in r]
    total, warm = 40, 8
    # the rate each step used: 0 for the first, peak after the warm-up, 1/32 of the peak for the last
    expected = [0.02 * (s / warm if s < warm else (total - s) / (total - warm)) for s in range(total)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-6, atol=1e-12)


def _release_warmup_linear(step: int, warmup: float, total: int) -> float:
    """pytorch-pretrained-bert's warmup_linear as LXMERT's BertAdam calls it: x = step / t_total."""
    x = step / total
    if x < warmup:
        return x / warmup
    return max((x - 1.0) / (warmup - 1.0), 0.0)


@pytest.mark.parametrize(
    ("ratio", "total"),
    [(0.05, 1000), (0.1, 48), (0.2, 40), (0.0, 16), (0.3, 7), (0.1, 25), (0.07, 9999), (0.15, 123)],
)
def test_linear_schedule_is_the_release_warmup_linear(ratio, total):
    """The warm-up lasts warmup_ratio x total steps, a fraction (0.3 x 7 = 2.1, not 2) as in the release,
    and every rate has the release's bits (BertAdam's updates are bitwise the release's only then)."""
    factor = trainer._schedule(TrainConfig(warmup_ratio=ratio), total)
    expected = [_release_warmup_linear(s, ratio, total) for s in range(total + 1)]
    assert [factor(s) for s in range(total + 1)] == expected


def test_linear_schedule_warms_up_from_warmup_factor():
    factor = trainer._schedule(TrainConfig(warmup_iters=4, warmup_factor=0.2, warmup_ratio=0.5), 20)
    rates = [factor(s) for s in range(6)]
    assert rates == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 15 / 16]) and factor(20) == 0.0


def _detectron2_lr(it: int, base: float, warmup: int, start: float, steps: list[int], gamma: float) -> float:
    """detectron2's WarmupMultiStepLR: linear warm-up from start x base, gamma per step reached."""
    if it < warmup:
        alpha = it / warmup
        rise = start * (1 - alpha) + alpha
    else:
        rise = 1.0
    return base * rise * gamma ** len([s for s in steps if s <= it])


def test_step_schedule_at_chosen_iterations():
    # detectron2's 3x recipe: 270k iterations, steps at 210k and 250k, 1000 warm-up iterations from 1/1000
    cfg = TrainConfig(schedule="steps", lr_steps=[210000, 250000], warmup_iters=1000, warmup_factor=0.001)
    factor = trainer._schedule(cfg, 270000)
    for it in (0, 1, 500, 999, 1000, 1001, 209999, 210000, 210001, 249999, 250000, 269999):
        want = _detectron2_lr(it, 0.02, 1000, 0.001, [210000, 250000], 0.1)
        assert 0.02 * factor(it) == pytest.approx(want, rel=1e-12), it
    assert factor(0) == pytest.approx(0.001) and factor(1000) == 1.0 and factor(250000) == pytest.approx(0.01)


def test_step_schedule_without_steps_is_constant_after_the_warm_up():
    factor = trainer._schedule(TrainConfig(schedule="steps", warmup_iters=4), 20)
    assert [factor(s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert factor(19) == 1.0


def test_step_schedule_drives_the_run(tmp_path):
    steps = [10, 17]
    cfg = _cfg(
        epochs=3,
        log_every=1,
        optimizer="sgd",
        schedule="steps",
        lr_steps=steps,
        lr_gamma=0.5,
        warmup_iters=5,
        warmup_factor=0.2,
        warmup_ratio=0.5,
    )
    fit(ToyTask(), cfg, tmp_path)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl") if "lr" in r]
    # the rate each of the 24 updates used: warmup_iters wins over warmup_ratio
    expected = [_detectron2_lr(it, 0.02, 5, 0.2, steps, 0.5) for it in range(24)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"lr_steps": [5, 5]}, "lr_steps must be positive, increasing"),
        ({"lr_steps": [8, 4]}, "lr_steps must be positive, increasing"),
        ({"lr_steps": [0, 4]}, r"train.lr_steps=\[0, 4\] is out of range"),
        ({"lr_gamma": 0.0}, r"train.lr_gamma=0.0 is out of range: must be \(0, 1\]"),
        ({"warmup_factor": 1.5}, r"train.warmup_factor=1.5 is out of range: must be \[0, 1\]"),
        ({"warmup_factor": -0.1}, r"train.warmup_factor=-0.1 is out of range"),
        ({"warmup_iters": -1}, "train.warmup_iters=-1 is out of range"),
        ({"momentum": -0.9}, r"train.momentum=-0.9 is out of range: must be \[0, 1\)"),
    ],
)
def test_bad_schedule_settings_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**bad)


def test_lr_steps_need_the_steps_schedule(tmp_path):
    with pytest.raises(ValueError, match="train.schedule=steps"):
        fit(ToyTask(), _cfg(lr_steps=[4]), tmp_path)


class _Crash(Exception):
    pass


class CrashingTask(ToyTask):
    """Dies in the loss of step `after` + 1, as a killed job would."""

    def __init__(self, after: int):
        self.calls, self.after = 0, after

    def loss(self, model, batch):
        self.calls += 1
        if self.calls > self.after:
            raise _Crash
        return super().loss(model, batch)


# detectron2's recipe in small: the checkpoint (step 10) falls between the rate's two drops
_SGD_STEPS = {
    "optimizer": "sgd",
    "schedule": "steps",
    "lr_steps": [6, 12],
    "warmup_iters": 4,
    "warmup_factor": 0.001,
}


@pytest.mark.parametrize(
    "recipe",
    [{"optimizer": "adamw"}, {"optimizer": "bertadam"}, _SGD_STEPS],
    ids=["adamw", "bertadam", "sgd-steps"],
)
def test_resume_is_exact(tmp_path, recipe):
    straight, first = tmp_path / "straight", tmp_path / "halves"
    fit(ToyTask(), _cfg(epochs=3, loader_workers=0, log_every=4, **recipe), straight)
    # crash mid-epoch just after the step-10 checkpoint (8 steps per epoch), with other loader workers
    with pytest.raises(_Crash):
        fit(
            CrashingTask(after=10),
            _cfg(epochs=3, save_every=10, loader_workers=2, log_every=4, **recipe),
            first,
        )
    assert latest_checkpoint(first / "checkpoints").name == "step-10"
    with pytest.raises(FileExistsError, match="--resume"):
        fit(ToyTask(), _cfg(epochs=3, **recipe), first)
    fit(ToyTask(), _cfg(epochs=3, loader_workers=1, log_every=4, **recipe), first, resume=True)
    a, b = _weights(straight / "last"), _weights(first / "last")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    rows_a = [r for r in read_metrics(straight / "metrics.jsonl") if "loss" in r]
    rows_b = [r for r in read_metrics(first / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows_a] == [r["step"] for r in rows_b]
    assert [r["lr"] for r in rows_a] == [r["lr"] for r in rows_b]
    # the row of step 12 averages steps 9-12, two of them before the checkpoint: the same means
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    assert latest_checkpoint(first / "checkpoints").name == "step-24"


def test_a_run_resumed_with_more_steps_decays_over_the_new_total(tmp_path):
    fit(ToyTask(), _cfg(max_steps=8, log_every=1, save_every=8), tmp_path)
    fit(ToyTask(), _cfg(max_steps=16, log_every=1), tmp_path, resume=True)
    rates = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r}
    assert rates[8] == pytest.approx(0.02 * (8 - 7) / (8 - 0.8))  # warm-up 0.1 * 8 = 0.8 steps
    # the rate each step uses: linear decay from lr over the new 16 steps (warm-up 0.1 * 16 = 1.6 steps)
    for step in range(9, 17):
        assert rates[step] == pytest.approx(0.02 * (16 - (step - 1)) / (16 - 1.6)), step


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    class NoDropout(ToyTask):
        def build_model(self):
            return torch.nn.Linear(4, 1)

        def collate(self, items, rng):
            return {
                "x": torch.from_numpy(np.stack([i[0] for i in items])),
                "y": torch.tensor([i[1] for i in items]),
            }

    fit(NoDropout(), _cfg(grad_accum=1), tmp_path / "one")
    fit(NoDropout(), _cfg(grad_accum=4), tmp_path / "four")
    a, b = _weights(tmp_path / "one" / "last"), _weights(tmp_path / "four" / "last")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_weight_decay_groups():
    model = ToyTask().build_model()
    groups = trainer._param_groups(model, TrainConfig(decay_norm_and_bias=False))
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and groups[1]["weight_decay"] == 0.0
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    (single,) = trainer._param_groups(model, TrainConfig())
    assert single["weight_decay"] == 0.01 and len(single["params"]) == 4


def test_bad_batch_layout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not divisible"):
        fit(ToyTask(), _cfg(batch_size=8, grad_accum=3), tmp_path)
    with pytest.raises(ValueError, match="fewer than one batch .*lower --batch-size"):
        fit(ToyTask(), _cfg(batch_size=128), tmp_path / "b")


def test_amp_is_cuda_only():
    assert trainer._amp_dtype("bf16", torch.device("cpu")) is None
    assert trainer._amp_dtype("auto", torch.device("cpu")) is None
    assert math.isclose(trainer._linear_schedule(0.1, 100)(5), 0.5)


class _ClipTask(ToyTask):
    """One fixed example: gradients (800, 0.8) on a two-weight linear model."""

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Linear(2, 1, bias=False)

    def train_dataset(self) -> Dataset:
        return [np.array([1.0, 0.001], dtype=np.float32)] * 8

    def valid_dataset(self):
        return None

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        return {"x": torch.from_numpy(np.stack(items))}

    def loss(self, model, batch):
        return 100.0 * model(batch["x"]).sum(), {}


@pytest.mark.parametrize("mode", ["value", "norm"])
def test_clip_value_clamps_each_gradient_element(tmp_path, mode):
    """self-critical.pytorch's grad_clip_mode=value: both gradients become 0.1; the norm would scale."""
    clip = {"clip_norm": None, "clip_value": 0.1} if mode == "value" else {"clip_norm": 0.1}
    cfg = _cfg(optimizer="sgd", momentum=0.0, weight_decay=0.0, lr=1.0, max_steps=1, warmup_ratio=0.0, **clip)
    fit(_ClipTask(), cfg, tmp_path)
    torch.manual_seed(cfg.seed)
    start = _ClipTask().build_model().weight.detach()
    after = _weights(tmp_path / "last")["weight"]
    if mode == "value":
        torch.testing.assert_close(after, start - 0.1)
    else:
        step = torch.tensor([[800.0, 0.8]]) * (0.1 / math.hypot(800.0, 0.8))
        torch.testing.assert_close(after, start - step)


def test_a_resume_with_a_new_learning_rate_is_refused_by_name(tmp_path):
    fit(ToyTask(), _cfg(max_steps=8, save_every=4), tmp_path)
    with pytest.raises(ValueError, match=r"train\.lr was 0\.02, now 0\.05") as refused:
        fit(ToyTask(), _cfg(max_steps=16, lr=0.05), tmp_path, resume=True)
    assert "train.max_steps" not in str(refused.value), "the run's length may change"
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-8", "nothing trained"
    with pytest.raises(ValueError, match=r"train\.optimizer was adamw, now sgd"):
        fit(ToyTask(), _cfg(max_steps=16, optimizer="sgd"), tmp_path, resume=True)


def test_config_yaml_keeps_the_start_and_history_records_each_resume(tmp_path):
    fit(ToyTask(), _cfg(max_steps=8, save_every=4), tmp_path)
    before = (tmp_path / "config.yaml").read_text()
    fit(ToyTask(), _cfg(max_steps=12, log_every=3), tmp_path, resume=True)
    assert (tmp_path / "config.yaml").read_text() == before, "config.yaml is the run as it began"
    starts = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [(s["start"], s["step"]) for s in starts] == [("new", 0), ("resume", 8)]
    assert starts[1]["changed"] == {
        "train.max_steps": [8, 12],
        "train.log_every": [2, 3],
        "train.save_every": [4, None],
    }
    assert starts[1]["config"]["train"]["max_steps"] == 12
    # a new run in the same directory (no checkpoint yet: the first start failed early) starts afresh
    other = tmp_path / "other"
    other.mkdir()
    (other / "history.jsonl").write_text(json.dumps({"config": {"train": {"lr": 9.0}}}) + "\n")
    fit(ToyTask(), _cfg(max_steps=2), other)
    (start,) = [json.loads(line) for line in (other / "history.jsonl").read_text().splitlines()]
    assert start["start"] == "new" and start["changed"] == {} and start["config"]["train"]["lr"] == 0.02


def test_a_fork_needs_a_checkpoint_to_go_on_from_and_a_new_run_directory(tmp_path):
    from pipelines.engine.run_history import fork

    with pytest.raises(ValueError, match=r"^--fork .*: no checkpoint to go on from"):
        fork(tmp_path / "nothing", tmp_path / "new")
    fit(ToyTask(), _cfg(max_steps=4), tmp_path / "a")
    fit(ToyTask(), _cfg(max_steps=4), tmp_path / "b")
    with pytest.raises(ValueError, match=r"^--out .*b already holds a run \(checkpoint step-4\)"):
        fork(tmp_path / "a", tmp_path / "b")
    (tmp_path / "a" / "ray_run.txt").write_text("an-earlier-ray-run\n")  # that run's, not the fork's
    assert fork(tmp_path / "a", tmp_path / "c") == 4
    assert not (tmp_path / "c" / "ray_run.txt").exists()
    fit(ToyTask(), _cfg(max_steps=8, lr=0.05), tmp_path / "c", resume=True)  # new settings: allowed once
    with pytest.raises(ValueError, match=r"train\.lr was 0\.05, now 0\.02"):
        fit(ToyTask(), _cfg(max_steps=12), tmp_path / "c", resume=True)  # then the fork's own are kept


class FlagSpyTask(ToyTask):
    """Records the TF32 flags at every loss and validation call."""

    def __init__(self):
        self.seen: list[dict[str, bool]] = []

    def loss(self, model, batch):
        self.seen.append(tf32_flags())
        return super().loss(model, batch)

    def evaluate(self, model, loader):
        self.seen.append(tf32_flags())
        return super().evaluate(model, loader)


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_is_the_run_config_choice_and_is_recorded(tmp_path, tf32):
    before = tf32_flags()
    task = FlagSpyTask()
    fit(task, _cfg(epochs=1, tf32=tf32), tmp_path)
    assert task.seen and all(seen == {"matmul": tf32, "cudnn": tf32} for seen in task.seen)
    assert tf32_flags() == before
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["tf32"] is tf32


def test_tf32_is_off_unless_asked_for():
    assert TrainConfig().tf32 is False


def test_a_tiny_set_is_validated_every_few_epochs_not_after_every_step(tmp_path):
    """15 pictures in batches of 32 make epochs of one step: validating at each epoch's end decoded the
    validation set after every step. Without train.eval_every, validation comes at epoch ends at least
    EPOCH_EVAL_MIN_STEPS steps apart (and at the last step); long epochs keep validating once each."""
    from pipelines.engine.trainer import EPOCH_EVAL_MIN_STEPS

    steps = EPOCH_EVAL_MIN_STEPS + 5
    fit(ToyTask(), _cfg(batch_size=64, epochs=steps, log_every=100), tmp_path / "tiny")  # 1 step an epoch
    rows = read_metrics(tmp_path / "tiny" / "metrics.jsonl")
    assert [r["step"] for r in rows if "valid_mse" in r] == [EPOCH_EVAL_MIN_STEPS, steps]
    fit(ToyTask(), _cfg(batch_size=2, epochs=2, log_every=100), tmp_path / "long")  # 32 steps an epoch
    rows = read_metrics(tmp_path / "long" / "metrics.jsonl")
    assert [r["step"] for r in rows if "valid_mse" in r] == [32, 64]
