"""Typed configs: YAML files, `key=value` overrides (nested), type checks, the SPEC's defaults."""

from __future__ import annotations

import pytest

from pipelines.engine import config_io
from pipelines.tasks.pretrain import PretrainRun


def test_spec_defaults():
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
        ("train.lr=fast", "expected a number"),
        ("train.batch_size=2.5", "expected an integer"),
        ("train.bogus=1", "unknown key 'bogus'"),
        ("task.masking.object_loss_on=some", "not one of"),
        ("task.masking.mlm=maybe", "true/false"),
        ("lr", "key=value"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        config_io.load(PretrainRun, None, [override])
