"""`xmodal pretrain` end to end on generated data (tiny preset): learning, run directory, resume, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipelines import config as config_io
from pipelines.cli import main as xmodal
from pipelines.pretrain import PretrainRun, PretrainTask
from pipelines.pretrain_data import read_pretrain_json
from pipelines.trainer import fit, latest_checkpoint, read_metrics

from .synthetic_pretrain import make_pretrain_data, tiny_run_overrides


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_pretrain_data(tmp_path_factory.mktemp("pretrain_data"))


def _args(data, out, *extra):
    return [
        "pretrain",
        "--features",
        str(data.features),
        "--train",
        str(data.train),
        "--vocab",
        str(data.vocab),
        "--out",
        str(out),
        *extra,
        *tiny_run_overrides(),
    ]


@pytest.mark.slow
def test_losses_fall_and_the_run_directory_is_complete(data, tmp_path):
    from model import Lxmert, LxmertForPreTraining

    out = tmp_path / "run"
    rc = xmodal(
        _args(
            data, out, "--valid", str(data.valid), "--max-steps", "48", "--batch-size", "16", "--lr", "2e-3"
        )
        + ["--save-every", "24", "task.qa_from_epoch=1", "task.qa_weight=2.0"]
    )
    assert rc == 0
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 49))
    first, last = train[:6], train[-6:]
    for key in ("loss", "mlm", "obj", "attr", "feat"):
        before, after = np.mean([r[key] for r in first]), np.mean([r[key] for r in last])
        assert after < 0.8 * before, f"{key} did not fall: {before:.3f} -> {after:.3f}"
    # QA joins at epoch 1 (12 steps per epoch) with weight 2: loss = sum of the parts + 1 x qa
    assert all("qa" not in r for r in train if r["epoch"] == 0)
    for r in (r for r in train if r["epoch"] >= 1):
        parts = sum(r[k] for k in ("mlm", "matched", "obj", "attr", "feat", "qa"))
        assert r["loss"] == pytest.approx(parts + r["qa"], rel=1e-4)
    valid = [r for r in rows if "valid_loss" in r]
    assert valid and {"valid_qa_accuracy", "valid_matched_accuracy", "valid_mlm"} <= set(valid[-1])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-24", "step-48"]
    for name in ("config.yaml", "vocab.txt", "ans2label.json", "curves.png", "summary.json"):
        assert (out / name).is_file(), name
    resolved = config_io.load(PretrainRun, out / "config.yaml")
    assert (
        resolved.train.max_steps == 48 and resolved.task.qa_weight == 2.0 and resolved.task.preset == "tiny"
    )
    answers = json.loads((out / "ans2label.json").read_text())
    assert set(answers) <= {"red", "green", "blue", "yellow", "purple"} and len(answers) == 5
    model = LxmertForPreTraining.from_pretrained(out / "last")
    assert model.config.visual_feat_dim == 32 and model.config.num_qa_labels == 5
    assert isinstance(Lxmert.from_pretrained(out / "last"), Lxmert)
    for name in ("vocab.txt", "ans2label.json", "config.json", "model.safetensors"):
        assert (out / "last" / name).is_file()


class _Crash(Exception):
    pass


class _CrashingTask(PretrainTask):
    def __init__(self, *args, after: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.after = 0, after

    def loss(self, model, batch):
        self.calls += 1
        if self.calls > self.after:
            raise _Crash
        return super().loss(model, batch)


def _run_config(data, **train):
    run = config_io.load(PretrainRun, None, tiny_run_overrides())
    task = {"features": [str(data.features)], "train_files": [str(data.train)], "vocab": str(data.vocab)}
    return config_io.merge(run, {"task": task, "train": {"batch_size": 8, "lr": 1e-3, **train}})


def test_resume_equals_an_uninterrupted_run(data, tmp_path):
    run = _run_config(data, max_steps=6, grad_accum=2)
    fit(PretrainTask(run.task), run.train, tmp_path / "straight")
    halves = tmp_path / "halves"
    with pytest.raises(_Crash):
        first = config_io.merge(run, {"train": {"save_every": 3, "loader_workers": 1}})
        fit(_CrashingTask(run.task, after=6), first.train, halves)  # 3 steps x 2 micro-batches, then dies
    assert latest_checkpoint(halves / "checkpoints").name == "step-3"
    fit(PretrainTask(run.task), run.train, halves, resume=True)
    a = load_file(tmp_path / "straight" / "last" / "model.safetensors")
    b = load_file(halves / "last" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)
    loss = lambda d: [r["loss"] for r in read_metrics(d / "metrics.jsonl") if "loss" in r]  # noqa: E731
    np.testing.assert_allclose(loss(halves), loss(tmp_path / "straight"), rtol=1e-5)


@pytest.mark.slow
def test_two_ray_workers_on_cpu_write_one_checkpoint(data, tmp_path):
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        out = tmp_path / "ray_run"
        rc = xmodal(
            _args(
                data,
                out,
                "--max-steps",
                "2",
                "--batch-size",
                "8",
                "--workers",
                "2",
                "--cpus-per-worker",
                "0.5",
            )
        )
    finally:
        ray.shutdown()
    assert rc == 0
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-2"]
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2], "only rank 0 writes metrics"
    assert json.loads((out / "summary.json").read_text())["step"] == 2
    assert (out / "last" / "model.safetensors").is_file()


def test_bad_json_names_the_file_and_row(data, tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text('[{"img_id": "img0000", "sentf": {"a": ["x"]}},')
    assert xmodal(_args(data, tmp_path / "r1") + ["--train", str(broken)]) == 2
    err = capsys.readouterr().err
    assert str(broken) in err and "not valid JSON" in err
    rows = json.loads(data.train.read_text())[:3]
    rows[2]["labelf"] = {"vqa": [{"red": 1.0}]}  # two questions, one label
    bad = tmp_path / "misaligned.json"
    bad.write_text(json.dumps(rows))
    with pytest.raises(
        ValueError, match=rf"{bad}: row 2 \(img_id 'img0002'\): labelf\['vqa'\] must be a list aligned"
    ):
        read_pretrain_json([bad])
    rows[2] = ["not", "an", "object"]
    bad.write_text(json.dumps(rows))
    with pytest.raises(ValueError, match="row 2: expected an object"):
        read_pretrain_json([bad])


def test_missing_images_error_or_skip(data, tmp_path, capsys):
    rows = json.loads(data.train.read_text())[:4]
    rows += [{"img_id": f"ghost{i}", "sentf": {"c": ["a red star"]}} for i in range(7)]
    path = tmp_path / "with_missing.json"
    path.write_text(json.dumps(rows))
    assert xmodal(_args(data, tmp_path / "r") + ["--train", str(path), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "7 of 11 image ids" in err and "ghost0" in err and "--skip-missing" in err
    cfg = _run_config(data).task
    cfg.train_files, cfg.skip_missing = [str(path)], True
    task = PretrainTask(cfg)
    assert {e.img_id for e in task.train_examples} == {r["img_id"] for r in rows[:4]}
    assert len(task.train_dataset()) == sum(len(s) for r in rows[:4] for s in r["sentf"].values())


def test_existing_run_is_not_overwritten(data, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints" / "step-5").mkdir(parents=True)
    (out / "checkpoints" / "step-5" / "trainer_state.pt").write_bytes(b"")
    (out / "vocab.txt").write_text("precious")
    assert xmodal(_args(data, out, "--max-steps", "1")) == 2
    assert "--resume" in capsys.readouterr().err
    assert (out / "vocab.txt").read_text() == "precious"
