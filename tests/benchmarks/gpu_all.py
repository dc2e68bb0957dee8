"""The GPU path checked and measured in one call that fits a budget (default 480 s of wall time, so one
lent machine's 15 minutes hold its start and a rerun): extraction checks and benches, then training
checks and benches, each step under the time left; a step that would overrun is skipped and named.

    python3 tests/benchmarks/gpu_all.py                      # on the device: every step, 480 s
    python3 tests/benchmarks/gpu_all.py --steps parity train_checks --budget 200
    python3 tests/benchmarks/gpu_all.py --device cpu         # dry run, small sizes (~1 min)

Every child runs under this interpreter (sys.executable). lmdb (which the store's steps need) is taken
from the environment, else installed from the wheels in .gpu_wheels/ (git-ignored; carry it to the device:
`make gpu-wheels` fetches them for CPython 3.10-3.13) into a private folder. Parity uses a trained
detector when `--detector-weights` names one (e.g. the demo's runs/detector/best), else a peaked random
class head (gpu_parity.py). Output: each step's lines in OUT/gpu_all.log, their JSON lines tagged with the
step in OUT/gpu_all.jsonl, a table, and one JSON line naming what ran, failed and was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
B = "tests/benchmarks"
WHEELS = ROOT / ".gpu_wheels"
MIN_STEP_S = 20  # a step is not started with less time than this left


@dataclass
class Step:
    name: str
    limit_s: int  # the most this step may take on the device (and the least it is started with, up to 60)
    args: list[str]
    tiny: list[str] | None  # the CPU dry run's arguments (None: the step needs CUDA, skipped on a CPU)


def steps(detector_weights: str | None) -> list[Step]:
    weights = ["--weights", detector_weights] if detector_weights else []
    extract = [f"{B}/bench_extract_gpu.py", "--via", "in-process"]
    parity = [f"{B}/gpu_parity.py", *weights]
    lxmert = [f"{B}/bench_model.py", "--device", "cuda", "--bf16", "--batch", "128", "--steps", "20"]
    lxmert += ["--no-memory", "--compile"]
    return [
        Step("env", 30, ["-c", ENV], ["-c", ENV]),
        Step(
            "parity",
            90,
            [*parity, "--device", "cuda"],
            [*parity, "--device", "cpu", "--quick", "--images", "2", "--forward", "batched"],
        ),
        Step(
            "train_checks",
            100,
            [f"{B}/gpu_train_checks.py", "--families", "lxmert"],
            [f"{B}/gpu_train_checks.py", "--device", "cpu", "--backend", "aot_eager", "--only", "bertadam"],
        ),
        Step("extract_checks", 120, ["tests/extraction/test_cuda_extraction.py"], None),
        Step(
            "extract_bench",
            130,
            [*extract, "--device", "cuda", "--images", "48"],
            [*extract, "--device", "cpu", "--quick", "--images", "2", "--dtypes", "float32"],
        ),
        Step("lxmert_compiled", 150, lxmert, None),
        Step("lxmert_cudagraphs", 120, [*lxmert, "--compile-mode", "reduce-overhead"], None),
    ]


ENV = (
    "import json, os, platform, torch; cuda = torch.cuda.is_available(); "
    "print(json.dumps({'name': 'gpu_env', 'python': platform.python_version(), 'torch': torch.__version__, "
    "'cuda': torch.version.cuda, 'device': torch.cuda.get_device_name() if cuda else 'cpu', "
    "'cudnn': torch.backends.cudnn.version() if cuda else None, 'cpus': os.cpu_count()}))"
)


def ensure_lmdb(out: Path, env: dict, log) -> str:
    """'present', 'installed from .gpu_wheels' or why it is missing; installs into out/site when needed."""
    if _runs([sys.executable, "-c", "import lmdb"], env):
        return "present"
    if not WHEELS.is_dir():
        return "missing (no .gpu_wheels/: run `make gpu-wheels` here and carry .gpu_wheels)"
    site = out / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(WHEELS)]
    done = subprocess.run([*pip, "--target", str(site), "lmdb"], capture_output=True, text=True, env=env)
    log.write(done.stdout + done.stderr)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(site)]))
    if _runs([sys.executable, "-c", "import lmdb"], env):
        return "installed from .gpu_wheels"
    return f"missing (no wheel in .gpu_wheels fits Python {sys.version_info.major}.{sys.version_info.minor})"


def _runs(cmd: list[str], env: dict) -> bool:
    return subprocess.run(cmd, capture_output=True, env=env).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds of wall time for every step")
    ap.add_argument("--steps", nargs="+", help="only these steps (default: all)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/gpu_all")))
    ap.add_argument("--detector-weights", help="a trained detector for the parity step")
    args = ap.parse_args()
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    plan = steps(args.detector_weights)
    unknown = set(args.steps or []) - {s.name for s in plan}
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; choose from {[s.name for s in plan]}")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(args.out / "inductor"))
    rows, skipped, failed = [], [], []
    with open(args.out / "gpu_all.log", "a") as log, open(args.out / "gpu_all.jsonl", "a") as jsonl:
        lmdb = ensure_lmdb(args.out, env, log)
        print(f"lmdb: {lmdb}", flush=True)
        for step in plan:
            if args.steps and step.name not in args.steps:
                continue
            step_args = step.tiny if args.device == "cpu" else step.args
            left = args.budget - (time.monotonic() - start)
            why = None
            if step_args is None:
                why = "needs CUDA"
            elif left < max(MIN_STEP_S, min(step.limit_s, 60) if args.device == "cuda" else MIN_STEP_S):
                why = f"{left:.0f} s left of the budget"
            if why is not None:
                skipped.append(step.name)
                rows.append((step.name, "skipped", 0.0, why))
                print(f"== {step.name}: skipped ({why})", flush=True)
                continue
            limit = min(step.limit_s, left) if args.device == "cuda" else left
            print(f"== {step.name} (limit {limit:.0f} s)", flush=True)
            t0 = time.monotonic()
            try:
                done = subprocess.run(
                    [sys.executable, *step_args],
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=limit,
                )
                rc, stdout, stderr = done.returncode, done.stdout, done.stderr
            except subprocess.TimeoutExpired as exc:
                rc = "timeout"
                stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
                stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
            seconds = time.monotonic() - t0
            log.write(f"== {step.name}: {step_args}\n{stdout}{stderr}== rc={rc} in {seconds:.1f} s\n")
            print(stdout, end="", flush=True)
            for line in stdout.splitlines():
                if line.startswith("{"):
                    jsonl.write(json.dumps({"step": step.name, **json.loads(line)}) + "\n")
            status = "ok" if rc == 0 else ("timeout" if rc == "timeout" else f"failed rc={rc}")
            if rc != 0:
                failed.append(step.name)
                print(stderr[-2000:], end="", file=sys.stderr)
            rows.append((step.name, status, seconds, ""))
    wall = time.monotonic() - start
    print(f"\n{'step':<20}{'status':<16}{'s':>7}  note")
    for name, status, seconds, note in rows:
        print(f"{name:<20}{status:<16}{seconds:>7.1f}  {note}")
    summary = {
        "name": "gpu_all",
        "device": args.device,
        "budget_s": args.budget,
        "wall_s": round(wall, 1),
        "lmdb": lmdb,
        "ran": [r[0] for r in rows if r[1] != "skipped"],
        "failed": failed,
        "skipped": skipped,
        "ratio": round(args.budget / max(wall, 1e-9), 2),  # budget / time taken: > 1 fits
    }
    print(json.dumps(summary))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
