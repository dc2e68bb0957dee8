"""Checkpoint states are read as tensors only: a state that would run code, or a stranger's file, is refused
on one line naming it, and `--resume` stops there (exit 1, no traceback)."""

from __future__ import annotations

import os

import pytest
import torch

from pipelines.cli import main as xmodal
from pipelines.engine.checkpoints import STATE_FILE, latest_checkpoint, read_state

from ..tasks.synthetic_pretrain import make_pretrain_data, tiny_run_overrides


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_state_that_would_run_code_is_refused(tmp_path):
    path = tmp_path / STATE_FILE
    torch.save({"model": {}, "x": _RunsCode(str(tmp_path / "ran"))}, path)
    with pytest.raises(ValueError) as err:
        read_state(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path} cannot be resumed from: it would import ")
    assert "system" in message and "never runs pickled code" in message
    assert not (tmp_path / "ran").exists()


def test_junk_and_foreign_states_are_named(tmp_path):
    path = tmp_path / STATE_FILE
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError, match=rf"^{path} cannot be resumed from: "):
        read_state(path)
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match=r"not a trainer state written by xmodal \(no model, optimizer"):
        read_state(path)


@pytest.mark.usefixtures("one_thread")
def test_resume_from_a_planted_state_exits_1_with_one_line(tmp_path, capsys):
    data = make_pretrain_data(tmp_path / "data", images=8, valid_images=2)
    out = tmp_path / "run"
    argv = [
        "pretrain",
        "--features",
        str(data.features),
        "--train",
        str(data.train),
        "--vocab",
        str(data.vocab),
    ]
    argv += ["--out", str(out), "--max-steps", "1", "--batch-size", "4", *tiny_run_overrides()]
    assert xmodal(argv) == 0
    state = latest_checkpoint(out / "checkpoints") / STATE_FILE
    torch.save({"step": _RunsCode(str(tmp_path / "ran"))}, state)
    capsys.readouterr()
    assert xmodal([*argv, "--resume"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"xmodal pretrain: {state} cannot be resumed from: it would import ")
    assert "\n" not in err
    assert not (tmp_path / "ran").exists()
