"""Progress on the console (a bar on a terminal, plain lines otherwise) and the experiment trackers."""

from __future__ import annotations

import logging
import os
import sys
import time

import pytest

from pipelines.engine.launch import fit
from pipelines.engine.run_log import read_metrics

sys.path.insert(0, os.path.dirname(__file__))
from test_trainer import ToyTask, _cfg  # noqa: E402


def test_without_a_terminal_rows_are_plain_lines_with_an_eta(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="pipelines.engine.run_log"):
        fit(ToyTask(), _cfg(epochs=1, log_every=2, trackers=[]), tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "pipelines.engine.run_log"]
    train = [line for line in lines if " loss=" in line]
    assert train and train[0].startswith("2/8 ")
    assert "samples_per_s=" in train[0] and " eta=0:00:" in train[0]
    assert all(" eta=" in line for line in lines if line[:1].isdigit())  # the last ones too: eta=0:00:00
    assert train[-1].startswith("8/8 ") and train[-1].endswith(" eta=0:00:00")


def test_on_request_a_bar_shows_step_loss_speed_and_eta(tmp_path, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="pipelines.engine.run_log"):
        fit(ToyTask(), _cfg(epochs=1, log_every=2, progress="bar", trackers=[]), tmp_path)
    err = capsys.readouterr().err
    assert "training" in err and "8/8" in err and "loss=" in err and "samples_per_s=" in err
    assert "<00:00" in err  # tqdm's elapsed<remaining
    assert not [r for r in caplog.records if " loss=" in r.getMessage()]  # no lines under the bar
    assert len([r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r]) == 4


def test_a_bad_progress_mode_or_tracker_stops_before_training(tmp_path):
    with pytest.raises(ValueError, match=r"train.progress=.fancy. must be one of"):
        fit(ToyTask(), _cfg(progress="fancy", trackers=[]), tmp_path / "a")
    with pytest.raises(ValueError, match=r"unknown tracker\(s\) \['neptune'\]"):
        fit(ToyTask(), _cfg(trackers=["neptune"]), tmp_path / "b")
    assert not (tmp_path / "b" / "checkpoints").exists()


def test_mlflow_file_store_gets_params_and_every_metric_row(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    out = tmp_path / "run"
    fit(ToyTask(), _cfg(epochs=1, log_every=2, trackers=["mlflow"]), out)
    run_id = (out / "mlflow_run_id").read_text().strip()
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(run_id)
    assert run.data.params["train.lr"] == "0.02" and run.info.status == "FINISHED"
    history = client.get_metric_history(run_id, "loss")
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert [m.step for m in history] == [r["step"] for r in rows]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in rows])


def test_wandb_offline_run_gets_the_config_and_rows(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    fit(ToyTask(), _cfg(epochs=1, log_every=2, trackers=["wandb"]), out)
    run_id = (out / "wandb_run_id").read_text().strip()
    run_dirs = list((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(run_dirs) == 1
    records = b""
    deadline = time.monotonic() + 60  # W&B's service process may still be flushing after finish()
    while b"samples_per_s" not in records and time.monotonic() < deadline:
        time.sleep(0.5)
        records = (run_dirs[0] / f"run-{run_id}.wandb").read_bytes()  # protobuf records, strings kept raw
    assert b"trackers" in records and b"samples_per_s" in records and b"loss" in records


def test_curves_are_drawn_again_only_after_new_rows(tmp_path, monkeypatch):
    import pipelines.engine.run_log as run_log

    drawn = []
    monkeypatch.setattr(run_log, "write_curves", lambda m, png: (drawn.append(png), png.write_bytes(b"png")))
    log = run_log.RunLog(tmp_path, enabled=True, trackers=[], progress="log")
    log.log({"step": 1, "loss": 1.0})
    log.curves()
    log.curves()  # the run's end right after its last checkpoint: nothing new to draw
    assert len(drawn) == 1
    log.log({"step": 2, "loss": 0.5})
    log.curves()
    assert len(drawn) == 2
    (tmp_path / run_log.CURVES_FILE).unlink()
    log.curves()  # a missing picture is drawn again
    assert len(drawn) == 3
    assert read_metrics(tmp_path / run_log.METRICS_FILE)[-1] == {"step": 2, "loss": 0.5}
