"""The LXMERT pre-training step of `model/` at an earlier commit (A) against the working tree's (B), both
in one process with the same weights and batch, alternating step by step so that load hits both alike.

    .venv/bin/python tests/benchmarks/bench_model_ab.py [--ref 7a4515c] [--steps 5] [--batch 8] [--swap]

Prints a table and a JSON line; `ratio` = A s/step ÷ B s/step (> 1: the working tree is faster).
`--swap` builds B before A (the build order alone can move the figures on a shared machine).
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
RESTRUCTURE_BASE = "7a4515c"  # main before the issue-13 restructure
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from bench_model import make_batch  # noqa: E402

from model import LxmertConfig, LxmertForPreTraining  # noqa: E402


def earlier_model(ref: str, into: Path):
    """`model/` at `ref`, importable as the package `model_at_ref` (it uses relative imports only)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "model"], capture_output=True)
    if archive.returncode:
        reason = archive.stderr.decode().strip()
        sys.exit(f"git archive {ref} model failed ({reason}): give --ref a commit this clone has")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    (into / "model").rename(into / "model_at_ref")
    sys.path.insert(0, str(into))
    return importlib.import_module("model_at_ref")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--ref",
        default=RESTRUCTURE_BASE,
        help=f"the earlier commit (A; default {RESTRUCTURE_BASE}, before issue 13)",
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps each (default 5)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--swap", action="store_true", help="build the working tree's model first")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        old_pkg = earlier_model(args.ref, Path(tmp))
        cfg = LxmertConfig.preset("base")
        batch = make_batch(cfg, args.batch, 20, 36)
        torch.manual_seed(0)
        builders = {
            "A": lambda: old_pkg.LxmertForPreTraining(old_pkg.LxmertConfig.preset("base")),
            "B": lambda: LxmertForPreTraining(cfg),
        }
        order = ("B", "A") if args.swap else ("A", "B")
        models = {name: builders[name]().train() for name in order}
        models[order[1]].load_state_dict(models[order[0]].state_dict())
        steps = {}
        for name, m in models.items():
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01, fused=True)

            def step(m=m, opt=opt) -> None:
                m(**batch).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            steps[name] = step
            step()  # warm-up
        times: dict[str, list[float]] = {"A": [], "B": []}
        for i in range(args.steps):
            for name in order if i % 2 == 0 else order[::-1]:
                start = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - start)
    median = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(
        f"LXMERT pre-training step, base, batch {args.batch}, fp32, {args.threads} threads, {args.steps} each"
    )
    print("side               s/step (median)  steps")
    for name, label in (("A", f"model/ at {args.ref}"), ("B", "working tree")):
        print(f"{label:18s} {median[name]:8.2f}         {[round(x, 2) for x in times[name]]}")
    print(f"ratio (A / B): {median['A'] / median['B']:.2f}")
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(json.dumps({
        "name": "lxmert_step_ab", "device": f"cpu ({platform.machine()}, {args.threads} threads)",
        "ref": args.ref, "batch": args.batch, "steps": args.steps, "built_first": order[0],
        "a_s_per_step": round(median["A"], 3), "b_s_per_step": round(median["B"], 3),
        "ratio": round(median["A"] / median["B"], 3), "loadavg": load,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
