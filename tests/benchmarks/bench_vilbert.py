"""Benchmark: one pre-training step of ViLBERT base against LXMERT base on the same batch shape, fp32 CPU
or bf16 GPU.

ViLBERT (bert_base_6layer_6conect: MLM, masked-region KL to a 1601-class distribution, alignment) and
LXMERT (MLM, matched, obj, attr, feat, QA), each forward + backward + AdamW(fused), alternating step by
step in one process; peak memory (VmHWM, or max allocated CUDA memory) of each in a child process of its
own. Prints the machine, the load average, a table and one JSON line.

    .venv/bin/python tests/benchmarks/bench_vilbert.py              # batch 4, 20 tokens, 36 boxes, 3 steps
    .venv/bin/python tests/benchmarks/bench_vilbert.py --batch 8 --steps 5
    .venv/bin/python tests/benchmarks/bench_vilbert.py --device cuda --bf16 --batch 128 --steps 20 --compile

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

from bench_model import add_step_options, synchronize, to_device  # noqa: E402

from model import LxmertConfig, LxmertForPreTraining  # noqa: E402
from model.layers.attention import static_layout  # noqa: E402
from model.vilbert import VilbertConfig, VilbertForPreTraining  # noqa: E402
from pipelines.engine.compiled import compile_model  # noqa: E402

TOKENS, BOXES = 20, 36


def shared_inputs(batch: int, vocab: int, feat_dim: int, g: torch.Generator) -> dict:
    """Sentences of 10-20 tokens padded to 20, 36 boxes, as both models read them."""
    lengths = torch.randint(TOKENS // 2, TOKENS + 1, (batch,), generator=g)
    pos = torch.arange(TOKENS)
    attention_mask = (pos[None] < lengths[:, None]).long()
    xy = torch.rand(batch, BOXES, 2, generator=g) * 0.6
    return {
        "input_ids": torch.randint(1000, vocab, (batch, TOKENS), generator=g) * attention_mask,
        "attention_mask": attention_mask,
        "token_type_ids": torch.zeros(batch, TOKENS, dtype=torch.long),
        "visual_feats": torch.rand(batch, BOXES, feat_dim, generator=g),
        "visual_pos": torch.cat([xy, xy + 0.3], dim=-1),
    }


def masked_tokens(inputs: dict, vocab: int, g: torch.Generator) -> torch.Tensor:
    mask = inputs["attention_mask"].bool()
    picked = mask & (torch.rand(mask.shape, generator=g) < 0.15)
    picked[:, 1] = True
    return torch.where(picked, torch.randint(0, vocab, mask.shape, generator=g), -100)


def vilbert_batch(cfg: VilbertConfig, batch: int) -> dict:
    g = torch.Generator().manual_seed(0)
    inputs = shared_inputs(batch, cfg.vocab_size, cfg.visual_feat_dim, g)
    return {
        **inputs,
        "lm_labels": masked_tokens(inputs, cfg.vocab_size, g),
        "matched_labels": torch.randint(0, 2, (batch,), generator=g),
        "region_mask": (torch.rand(batch, BOXES, generator=g) < 0.15).float(),
        "region_probs": torch.softmax(torch.randn(batch, BOXES, cfg.v_target_size, generator=g), -1),
    }


def lxmert_batch(cfg: LxmertConfig, batch: int) -> dict:
    g = torch.Generator().manual_seed(0)
    inputs = shared_inputs(batch, cfg.vocab_size, cfg.visual_feat_dim, g)
    answers = torch.randint(0, cfg.num_qa_labels, (batch,), generator=g)
    answers[torch.rand(batch, generator=g) < 0.5] = -100
    return {
        **inputs,
        "lm_labels": masked_tokens(inputs, cfg.vocab_size, g),
        "matched_labels": torch.randint(0, 2, (batch,), generator=g),
        "obj_labels": torch.randint(0, cfg.num_object_labels, (batch, BOXES), generator=g),
        "obj_weights": torch.rand(batch, BOXES, generator=g),
        "attr_labels": torch.randint(0, cfg.num_attr_labels, (batch, BOXES), generator=g),
        "attr_weights": torch.rand(batch, BOXES, generator=g),
        "feat_targets": torch.rand(batch, BOXES, cfg.visual_feat_dim, generator=g),
        "feat_weights": (torch.rand(batch, BOXES, generator=g) < 0.15).float(),
        "answer_labels": answers,
    }


def build(which: str, batch: int, device: str = "cpu", bf16: bool = False, compiled: str | None = None):
    """(parameter count, step function) for 'vilbert' or 'lxmert' at base size; `compiled`: None or a
    torch.compile mode."""
    torch.manual_seed(0)
    if which == "vilbert":
        cfg = VilbertConfig.preset("base")
        model, data = VilbertForPreTraining(cfg), vilbert_batch(cfg, batch)
    else:
        cfg = LxmertConfig.preset("base")
        model, data = LxmertForPreTraining(cfg), lxmert_batch(cfg, batch)
    model.to(device).train()
    data = to_device(data, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    stepped = model if compiled is None else compile_model(model, None if compiled == "default" else compiled)

    def step() -> torch.Tensor:
        # compiled as the trainer runs it: padded rows, shapes from the batch size alone
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16), static_layout(stepped is not model):
            loss = stepped(**data).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return sum(p.numel() for p in model.parameters()), step


def peak_memory_child(which: str, batch: int, device: str, bf16: bool, compiled: str | None) -> None:
    _, step = build(which, batch, device, bf16, compiled)
    for _ in range(3 if compiled else 1):
        step()
    synchronize(device)
    if device == "cuda":
        print(json.dumps({"peak_mb": torch.cuda.max_memory_allocated() / 2**20}))
        return
    # VmHWM (peak resident set) starts afresh at exec, unlike ru_maxrss which a forked child inherits.
    status = Path("/proc/self/status").read_text()
    hwm_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    print(json.dumps({"peak_mb": hwm_kb / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per model")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    add_step_options(ap, compiled="both steps compiled, as train.compile=on")
    ap.add_argument("--memory-child", choices=["vilbert", "lxmert"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    compiled = args.compile_mode if args.compile else None
    if args.memory_child:
        peak_memory_child(args.memory_child, args.batch, args.device, args.bf16, compiled)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")

    names = ("vilbert", "lxmert")
    start = time.perf_counter()
    built = {name: build(name, args.batch, args.device, args.bf16, compiled) for name in names}
    params = {name: b[0] for name, b in built.items()}
    runners = {name: b[1] for name, b in built.items()}
    print(f"built in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    losses = {name: float(run()) for name, run in runners.items()}  # warm-up: allocates AdamW's state
    for _ in range(3 if compiled else 0):  # compiling settles (CUDA graphs record on the third call)
        for run in runners.values():
            run()
    synchronize(args.device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.steps):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run()
            synchronize(args.device)
            times[name].append(time.perf_counter() - t0)
            print(f"{name} step: {times[name][-1]:.2f} s", file=sys.stderr, flush=True)
    del built, runners
    peak = {}
    if not args.no_memory:
        for name in names:
            cmd = [sys.executable, __file__, "--memory-child", name, "--batch", str(args.batch)]
            cmd += ["--device", args.device] + (["--bf16"] if args.bf16 else [])
            cmd += ["--compile", "--compile-mode", args.compile_mode] if compiled else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            peak[name] = json.loads(out.strip().splitlines()[-1])["peak_mb"]

    seconds = {name: sum(t) / len(t) for name, t in times.items()}
    load = os.getloadavg()
    cuda = args.device == "cuda"
    device = (
        torch.cuda.get_device_name()
        if cuda
        else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    precision = "bf16 autocast" if args.bf16 else "fp32"
    memory = "peak_cuda_mb" if cuda else "peak_rss_mb"
    how = f"compiled ({compiled})" if compiled else "eager"
    averages = " ".join(f"{x:.1f}" for x in load)
    print(f"pre-training step, base configs, batch {args.batch}, {TOKENS} tokens, {BOXES} boxes, "
          f"{precision}, {device}, load average {averages}, {args.steps} alternating steps, "
          f"{how}")  # fmt: skip
    print(f"{'model':<10}{'params':>14}{'s/step':>10}{'samples/s':>11}{memory:>14}{'first loss':>12}")
    for name in names:
        mem = f"{peak[name]:.0f}" if name in peak else "-"
        rate = args.batch / seconds[name]
        print(f"{name:<10}{params[name]:>14,}{seconds[name]:>10.3f}{rate:>11.1f}{mem:>14}"
              f"{losses[name]:>12.4f}")  # fmt: skip
    print(f"ratio (ViLBERT / LXMERT s/step): {seconds['vilbert'] / seconds['lxmert']:.2f}")
    print(json.dumps({
        "name": "vilbert_vs_lxmert_pretrain_step", "device": device,
        "load_average": [round(x, 2) for x in load],
        "batch": args.batch, "tokens": TOKENS, "boxes": BOXES, "steps": args.steps,
        "precision": precision, "compile": compiled or "off",
        **{f"{n}_params": params[n] for n in names},
        **{f"{n}_s_per_step": round(seconds[n], 4) for n in names},
        **{f"{n}_samples_per_s": round(args.batch / seconds[n], 1) for n in names},
        **{f"{n}_{memory}": round(peak.get(n, 0)) for n in names},
        **{f"{n}_step_s": [round(x, 4) for x in times[n]] for n in names},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
