"""A model too big for this machine's memory is refused in one line before any of its tensors exist."""

from __future__ import annotations

import psutil
import pytest
import torch
from torch import nn

from pipelines.cli import main as xmodal
from pipelines.engine import model_memory
from pipelines.engine.model_memory import ModelTooLarge, check_model_fits, training_bytes

from ..tasks.synthetic_pretrain import make_pretrain_data, tiny_run_overrides


def test_training_bytes_counts_weights_gradients_and_the_optimizer_state():
    model = nn.Sequential(nn.Linear(10, 20), nn.BatchNorm1d(20))
    params = 10 * 20 + 20 + 20 + 20  # linear weight and bias, batch-norm weight and bias
    buffers = (20 + 20) * 4 + 8  # running mean and variance (float32), num_batches_tracked (int64)
    assert training_bytes(model, "adamw") == params * 4 * 4 + buffers  # weight, gradient, m, v
    assert training_bytes(model, "sgd", momentum=0.9) == params * 4 * 3 + buffers
    assert training_bytes(model, "sgd", momentum=0.0) == params * 4 * 2 + buffers


def test_the_probe_allocates_nothing_and_refuses_what_does_not_fit():
    def build():
        return nn.Linear(1 << 16, 1 << 16)  # 4.3 G parameters: 64 GiB of weights alone, were it real

    before = psutil.Process().memory_info().rss
    with pytest.raises(ModelTooLarge, match=r"4,295\.0 M parameters: .* more than the"):
        check_model_fits(build, "adamw", 0.0, torch.device("cpu"))
    assert psutil.Process().memory_info().rss - before < 256 * 2**20
    check_model_fits(lambda: nn.Linear(8, 8), "adamw", 0.0, torch.device("cpu"))  # fits: no error


def test_pretrain_refuses_a_model_bigger_than_memory_before_the_run_starts(tmp_path, capsys):
    data = make_pretrain_data(tmp_path / "data", images=8, valid_images=0)
    out = tmp_path / "run"
    argv = ["pretrain", "--features", str(data.features), "--train", str(data.train)]
    argv += ["--vocab", str(data.vocab), "--out", str(out), "--max-steps", "1", "--batch-size", "4"]
    argv += tiny_run_overrides()
    huge = "task.model={num_object_labels: 8, num_attr_labels: 6, hidden_size: 16384, "
    huge += "intermediate_size: 65536, num_attention_heads: 64, l_layers: 64}"
    assert xmodal([*argv, huge]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "M parameters" in err[0] and "GiB" in err[0] and "Traceback" not in err[0]
    # the task's own files (vocabulary, token cache) may be there; the run itself never began
    assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()


def test_a_model_that_fits_trains_as_before(tmp_path, monkeypatch):
    data = make_pretrain_data(tmp_path / "data", images=8, valid_images=0)
    seen = []
    monkeypatch.setattr(model_memory, "free_bytes", lambda device: seen.append(device) or 2**40)
    argv = ["pretrain", "--features", str(data.features), "--train", str(data.train)]
    argv += ["--vocab", str(data.vocab), "--out", str(tmp_path / "run"), "--max-steps", "1"]
    argv += ["--batch-size", "4", *tiny_run_overrides()]
    assert xmodal(argv) == 0 and seen == [torch.device("cpu")]
