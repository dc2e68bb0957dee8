"""Benchmark: one pre-training step of VL-BERT base against one of LXMERT base, fp32 CPU or bf16 GPU.

Same sentences, regions and masks for both: LXMERT with its five losses and QA (as bench_model.py),
VL-BERT with masked LM and masked RoI classification against a 1601-class distribution. The two
alternate step by step in one process, so the host's load hits both alike; peak memory (VmHWM, or max
allocated CUDA memory) of each is taken in a child process of its own. Prints a table and a JSON line.

    .venv/bin/python tests/benchmarks/bench_onestream.py             # batch 16, 20 tokens, 36 boxes
    .venv/bin/python tests/benchmarks/bench_onestream.py --quick     # batch 4, 2 timed steps
    .venv/bin/python tests/benchmarks/bench_onestream.py --device cuda --bf16 [--compile]

`--compile`: both steps as the trainer runs them with `train.compile=on`; every timed step ends with a
device synchronisation.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import add_step_options, make_batch, synchronize, to_device  # noqa: E402

from model import LxmertConfig, LxmertForPreTraining  # noqa: E402
from model.layers.attention import static_layout  # noqa: E402
from model.vlbert import VlBertConfig, VlBertForPreTraining  # noqa: E402
from pipelines.engine.compiled import compile_model  # noqa: E402

TOKENS, BOXES = 20, 36


def vlbert_batch(lxmert_batch: dict, classes: int, seed: int = 1) -> dict:
    """The LXMERT batch's sentences, regions, masked words and masked regions, VL-BERT's targets."""
    g = torch.Generator().manual_seed(seed)
    b = lxmert_batch
    masked = b["feat_weights"] > 0
    return {
        "input_ids": b["input_ids"],
        "attention_mask": b["attention_mask"],
        "token_type_ids": b["token_type_ids"],
        "visual_feats": b["visual_feats"],
        "visual_pos": b["visual_pos"],
        "lm_labels": b["lm_labels"],
        "region_mask": masked.float(),
        "region_probs": torch.softmax(torch.randn(*masked.shape, classes, generator=g), -1),
    }


def build(which: str, batch: int, device: str, bf16: bool, compiled: str | None = None):
    """The step function on that model's batch on `device`; `compiled`: None or a torch.compile mode."""
    torch.manual_seed(0)
    lx_cfg = LxmertConfig.preset("base")
    data = make_batch(lx_cfg, batch, TOKENS, BOXES)
    if which == "vlbert":
        cfg = VlBertConfig.preset("base")
        model: torch.nn.Module = VlBertForPreTraining(cfg)
        data = vlbert_batch(data, cfg.num_region_classes)
    else:
        model = LxmertForPreTraining(lx_cfg)
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    data = to_device(data, device)
    stepped = model if compiled is None else compile_model(model, None if compiled == "default" else compiled)

    def step() -> torch.Tensor:
        # compiled as the trainer runs it: padded rows, shapes from the batch size alone
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16), static_layout(stepped is not model):
            loss = stepped(**data).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def peak_memory_child(which: str, batch: int, device: str, bf16: bool, compiled: str | None) -> None:
    step = build(which, batch, device, bf16, compiled)
    for _ in range(3 if compiled else 1):
        step()
    synchronize(device)
    if device == "cuda":
        print(json.dumps({"peak_mb": torch.cuda.max_memory_allocated() / 2**20}))
        return
    status = Path("/proc/self/status").read_text()
    hwm_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    print(json.dumps({"peak_mb": hwm_kb / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 4, 2 timed steps each")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per model")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    add_step_options(ap, compiled="both steps compiled, as train.compile=on")
    ap.add_argument("--memory-child", choices=["vlbert", "lxmert"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    compiled = args.compile_mode if args.compile else None
    batch = args.batch or (4 if args.quick else 16)
    steps = args.steps or (2 if args.quick else 4)
    if args.memory_child:
        peak_memory_child(args.memory_child, batch, args.device, args.bf16, compiled)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")

    names = ("vlbert", "lxmert")
    runners = {name: build(name, batch, args.device, args.bf16, compiled) for name in names}
    losses = {name: float(run()) for name, run in runners.items()}  # warm-up: AdamW state, allocations
    for _ in range(3 if compiled else 0):  # compiling settles (CUDA graphs record on the third call)
        for run in runners.values():
            run()
    synchronize(args.device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(steps):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run()
            synchronize(args.device)
            times[name].append(time.perf_counter() - t0)
    del runners
    for name, t in times.items():
        print(f"{name} seconds per step: {', '.join(f'{x:.2f}' for x in t)}", file=sys.stderr, flush=True)

    peak = {}
    if not args.no_memory:
        for name in names:
            cmd = [
                sys.executable,
                __file__,
                "--memory-child",
                name,
                "--batch",
                str(batch),
                "--device",
                args.device,
            ]
            cmd += ["--bf16"] if args.bf16 else []
            cmd += ["--compile", "--compile-mode", args.compile_mode] if compiled else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            peak[name] = json.loads(out.strip().splitlines()[-1])["peak_mb"]

    seconds = {name: sum(t) / len(t) for name, t in times.items()}
    cuda = args.device == "cuda"
    precision = "bf16 autocast" if args.bf16 else "fp32"
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    memory = "peak_cuda_mb" if cuda else "peak_rss_mb"
    print(f"pre-training step, base configs, batch {batch}, {TOKENS} tokens, {BOXES} boxes, {precision}, "
          f"{where}, {steps} alternating steps, load average {os.getloadavg()[0]:.1f}, "
          f"{f'compiled ({compiled})' if compiled else 'eager'}")  # fmt: skip
    print(f"{'model':<10}{'s/step':>10}{memory:>14}{'first loss':>12}")
    for name, label in (("vlbert", "VL-BERT"), ("lxmert", "LXMERT")):
        mem = f"{peak[name]:.0f}" if name in peak else "-"
        print(f"{label:<10}{seconds[name]:>10.2f}{mem:>14}{losses[name]:>12.4f}")
    print(f"VL-BERT / LXMERT seconds per step: {seconds['vlbert'] / seconds['lxmert']:.2f}")
    device = (
        where
        if cuda
        else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    print(json.dumps({
        "name": "onestream_pretrain_step", "device": device, "precision": precision,
        "batch": batch, "tokens": TOKENS, "boxes": BOXES, "steps": steps, "compile": compiled or "off",
        "vlbert_samples_per_s": round(batch / seconds["vlbert"], 1),
        "lxmert_samples_per_s": round(batch / seconds["lxmert"], 1),
        "load_average": round(os.getloadavg()[0], 2),
        "vlbert_s_per_step": round(seconds["vlbert"], 3), "lxmert_s_per_step": round(seconds["lxmert"], 3),
        f"vlbert_{memory}": round(peak.get("vlbert", 0)), f"lxmert_{memory}": round(peak.get("lxmert", 0)),
        "vlbert_step_s": [round(x, 3) for x in times["vlbert"]],
        "lxmert_step_s": [round(x, 3) for x in times["lxmert"]],
        "ratio": round(seconds["vlbert"] / seconds["lxmert"], 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
