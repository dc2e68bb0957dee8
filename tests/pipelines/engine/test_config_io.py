"""Typed configs: YAML files, `key=value` overrides (nested), type checks, the release's defaults."""

from __future__ import annotations

import pytest

from pipelines.engine import config_io
from pipelines.tasks.pretrain import PretrainRun


def test_release_defaults():
    run = PretrainRun()
    t = run.train
    assert (t.lr, t.batch_size, t.epochs, t.warmup_ratio, t.clip_norm, t.weight_decay) == (
        1e-4,
        256,
        20,
        0.05,
        1.0,
        0.01,
    )
    assert t.decay_norm_and_bias  # the release decays every parameter
    assert t.optimizer == "bertadam"
    m = run.task.masking
    assert (m.mlm_prob, m.object_prob, m.mismatch_prob, m.max_seq_len, m.object_loss_on) == (
        0.15,
        0.15,
        0.5,
        20,
        "all",
    )
    assert run.task.qa_from_epoch == 0 and run.task.qa_weight == 1.0


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 3.0e-5\n  max_steps: 100\ntask:\n  masking:\n    mlm: false\n")
    run = config_io.load(
        PretrainRun,
        path,
        ["train.lr=1e-3", "task.masking.object_loss_on=masked", "task.model={hidden_size: 32}"],
    )
    assert run.train.lr == 1e-3 and run.train.max_steps == 100 and run.train.batch_size == 256
    assert run.task.masking.mlm is False and run.task.masking.object_loss_on == "masked"
    assert run.task.model == {"hidden_size": 32}
    assert config_io.load(PretrainRun, None, ["train.max_steps=null"]).train.max_steps is None
    config_io.save_yaml(run, tmp_path / "saved.yaml")
    assert config_io.load(PretrainRun, tmp_path / "saved.yaml") == run


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lr=fast", "train.lr=.fast. must be a number"),
        ("train.batch_size=2.5", "train.batch_size=2.5 must be an integer"),
        ("train.bogus=1", "unknown key 'train.bogus'"),
        ("task.masking.object_loss_on=some", "not one of"),
        ("task.masking.mlm=maybe", "true/false"),
        ("lr", "key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        config_io.load(PretrainRun, None, [override])


def test_optimizer_override_is_checked():
    assert config_io.load(PretrainRun, None, ["train.optimizer=adamw"]).train.optimizer == "adamw"
    assert config_io.load(PretrainRun, None, ["train.optimizer=sgd"]).train.optimizer == "sgd"
    with pytest.raises(ValueError, match="optimizer"):
        config_io.load(PretrainRun, None, ["train.optimizer=lamb"])


def test_step_schedule_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "detector.yaml"
    path.write_text(
        "train:\n  optimizer: sgd\n  schedule: steps\n  lr_steps: [210000, 250000]\n"
        "  warmup_iters: 1000\n  warmup_factor: 0.001\n  momentum: 0.9\n"
    )
    t = config_io.load(PretrainRun, path, ["train.lr_steps=[60000, 80000]", "train.lr_gamma=0.5"]).train
    assert (t.optimizer, t.schedule, t.lr_steps, t.lr_gamma) == ("sgd", "steps", [60000, 80000], 0.5)
    assert (t.warmup_iters, t.warmup_factor, t.momentum) == (1000, 0.001, 0.9)
    run = config_io.load(PretrainRun, path, ["train.warmup_factor=1e-3", "train.warmup_iters=null"])
    assert run.train.warmup_factor == 0.001 and run.train.warmup_iters is None
    config_io.save_yaml(run, tmp_path / "saved.yaml")
    assert config_io.load(PretrainRun, tmp_path / "saved.yaml") == run
    assert config_io.load(PretrainRun, None, ["train.lr_steps=[]"]).train.lr_steps == []


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.schedule=cosine", "not one of"),
        ("train.lr_steps=100", "must be a list"),
        ("train.lr_steps=[100, 1.5]", "must be an integer"),
        ("train.lr_steps=[200, 100]", "positive, increasing"),
        ("train.warmup_factor=2", r"\[0, 1\]"),
    ],
)
def test_bad_schedule_overrides(override, message):
    with pytest.raises(ValueError, match=message):
        config_io.load(PretrainRun, None, [override])


HOSTILE = [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/name:os.system",
    "!!python/object/new:subprocess.Popen [['touch', '{marker}']]",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_yaml_tags_that_build_objects_are_refused_in_files_and_overrides(value, tmp_path, capsys):
    from pipelines.cli import main

    marker = tmp_path / "ran"
    value = value.format(marker=marker)
    config = tmp_path / "evil.yaml"
    config.write_text(f"train:\n  lr: {value}\n")
    with pytest.raises(ValueError, match=r"evil\.yaml: refused YAML at line 2, column 7 \(.*never objects"):
        config_io.load(PretrainRun, config)
    with pytest.raises(ValueError, match=r"override .*: refused YAML at line 1"):
        config_io.load(PretrainRun, overrides=[f"train.lr={value}"])
    argv = ["--features", "f", "--train", "t", "--out", str(tmp_path / "o")]
    for command in (["pretrain", *argv, "--config", str(config)], ["finetune", "vqa", *argv, f"lr={value}"]):
        assert main(command) == 1
        err = capsys.readouterr().err.strip()
        assert "refused YAML" in err and "\n" not in err
    assert main(["extract", "imgs", "--out", str(tmp_path / "x.lmdb"), "--set", f"nms_thresh={value}"]) == 1
    assert not marker.exists()


def test_unreadable_config_is_one_line(tmp_path):
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"train: \xff\xfe\n")
    with pytest.raises(ValueError, match=r"config '.*c\.yaml' is not UTF-8 text"):
        config_io.load(PretrainRun, binary)
    with pytest.raises(ValueError, match=r"is a directory; give a regular file"):
        config_io.load(PretrainRun, tmp_path)
