"""The one-call GPU script (gpu_all.py) as a CPU dry run: every step a CPU can run runs at small sizes and
passes, the CUDA-only ones are named as skipped, and steps that would overrun the budget are skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/benchmarks/gpu_all.py"
CUDA_ONLY = ["extract_checks", "lxmert_compiled", "lxmert_cudagraphs"]


def _run(*args: str) -> tuple[subprocess.CompletedProcess, dict]:
    command = [sys.executable, SCRIPT, "--device", "cpu", *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    return done, json.loads(done.stdout.strip().splitlines()[-1])


def test_the_dry_run_runs_every_step_a_cpu_can_and_names_the_others(tmp_path):
    done, summary = _run("--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary["ran"] == ["env", "parity", "train_checks", "extract_bench"]
    assert summary["failed"] == [] and summary["skipped"] == CUDA_ONLY
    assert summary["lmdb"] in ("present", "installed from .gpu_wheels")
    lines = [json.loads(line) for line in (tmp_path / "gpu_all.jsonl").read_text().splitlines()]
    by_step = {line["step"]: line for line in lines}
    parity = by_step["parity"]
    assert parity["ok"] and parity["same"] + parity["tied"] == parity["images"] and parity["same"] > 0
    assert parity["forward"] == "batched" and parity["max_feature_rel_diff"] <= 1e-5
    assert by_step["train_checks"] == {
        "step": "train_checks",
        "name": "gpu_check_bertadam",
        "bitwise_equal": True,
        "max_abs_diff": 0.0,
    }
    assert by_step["extract_bench"]["name"] == "extract_gpu" and by_step["env"]["device"] == "cpu"
    for name in CUDA_ONLY:
        assert f"== {name}: skipped (needs CUDA)" in done.stdout


def test_steps_that_would_overrun_the_budget_are_skipped_and_named(tmp_path):
    steps = ["env", "parity", "extract_checks"]
    done, summary = _run("--out", str(tmp_path), "--budget", "5", "--steps", *steps)
    assert done.returncode == 0
    assert summary["ran"] == [] and summary["skipped"] == steps
    assert "== parity: skipped (5 s left of the budget)" in done.stdout
    assert "== extract_checks: skipped (needs CUDA)" in done.stdout
