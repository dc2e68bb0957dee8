"""Benchmark: one LXMERT pre-training step (forward, five losses + QA, backward, AdamW), fp32 CPU or bf16 GPU.

xmodal's `LxmertForPreTraining` against `transformers.LxmertForPreTraining` with the same weights, inputs
and losses, alternating step by step in one process; peak memory (max RSS) of each measured in a child
process of its own (max RSS on CPU, max allocated CUDA memory on a GPU). Prints a table and one JSON
line; `ratio` = ours / transformers steps per second.

    .venv/bin/python tests/benchmarks/bench_model.py            # base config, batch 32, 20 tokens, 36 boxes
    .venv/bin/python tests/benchmarks/bench_model.py --quick    # batch 8, fewer steps
    .venv/bin/python tests/benchmarks/bench_model.py --device cuda --bf16    # both under bf16 autocast
    .venv/bin/python tests/benchmarks/bench_model.py --device cuda --bf16 --batch 128 --compile

`--compile`: xmodal's step as the trainer runs it with `train.compile=on` (torch.compile, inductor;
`--compile-mode reduce-overhead` adds CUDA graphs); transformers stays eager. Every timed step ends with
a device synchronisation, and nothing inside a step waits for the device.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model import LxmertConfig, LxmertForPreTraining, to_hf_state  # noqa: E402
from model.layers.attention import static_layout  # noqa: E402
from pipelines.engine.compiled import compile_model  # noqa: E402

HF_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "l_layers", "r_layers",
    "x_layers", "visual_feat_dim", "num_object_labels", "num_attr_labels", "num_qa_labels",
)  # fmt: skip


def make_batch(cfg: LxmertConfig, batch: int, tokens: int, boxes: int, seed: int = 0) -> dict:
    """A realistic pre-training batch: padded sentences, 15% masked tokens/objects, some QA labels."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(tokens // 2, tokens + 1, (batch,), generator=g)
    pos = torch.arange(tokens)
    attention_mask = (pos[None] < lengths[:, None]).long()
    inner = (pos[None] > 0) & (pos[None] < lengths[:, None] - 1)
    picked = inner & (torch.rand(batch, tokens, generator=g) < 0.15)
    picked[:, 1] = True  # at least one masked token per sentence
    input_ids = torch.randint(1000, cfg.vocab_size, (batch, tokens), generator=g) * attention_mask
    masked_boxes = (torch.rand(batch, boxes, generator=g) < 0.15).float()
    answers = torch.randint(0, cfg.num_qa_labels, (batch,), generator=g)
    answers[torch.rand(batch, generator=g) < 0.5] = -100
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": torch.zeros_like(input_ids),
        "visual_feats": torch.rand(batch, boxes, cfg.visual_feat_dim, generator=g),
        "visual_pos": torch.rand(batch, boxes, 4, generator=g),
        "lm_labels": torch.where(
            picked, torch.randint(0, cfg.vocab_size, (batch, tokens), generator=g), -100
        ),
        "matched_labels": torch.randint(0, 2, (batch,), generator=g),
        "obj_labels": torch.randint(0, cfg.num_object_labels, (batch, boxes), generator=g),
        "obj_weights": torch.rand(batch, boxes, generator=g),
        "attr_labels": torch.randint(0, cfg.num_attr_labels, (batch, boxes), generator=g),
        "attr_weights": torch.rand(batch, boxes, generator=g),
        "feat_targets": torch.rand(batch, boxes, cfg.visual_feat_dim, generator=g),
        "feat_weights": masked_boxes,
        "answer_labels": answers,
    }


def hf_kwargs(b: dict) -> dict:
    return {
        "input_ids": b["input_ids"],
        "attention_mask": b["attention_mask"],
        "token_type_ids": b["token_type_ids"],
        "visual_feats": b["visual_feats"],
        "visual_pos": b["visual_pos"],
        "labels": b["lm_labels"],
        "matched_label": b["matched_labels"],
        "obj_labels": {
            "obj": (b["obj_labels"], b["obj_weights"]),
            "attr": (b["attr_labels"], b["attr_weights"]),
            "feat": (b["feat_targets"], b["feat_weights"]),
        },
        "ans": b["answer_labels"],
    }


def build(
    which: str, cfg: LxmertConfig, device: str = "cpu", bf16: bool = False, compiled: str | None = None
):
    """(model, step function) with identical weights for both implementations; `compiled`: None (eager)
    or the torch.compile mode of xmodal's step ("default", "reduce-overhead", ...)."""
    torch.manual_seed(0)
    ours = LxmertForPreTraining(cfg)
    if which == "ours":
        model, call = ours, lambda m, b: m(**b).loss
    else:
        import transformers

        hc = transformers.LxmertConfig(
            **{k: getattr(cfg, k) for k in HF_FIELDS}, visual_loss_normalizer=cfg.visual_loss_scale
        )
        model = transformers.LxmertForPreTraining(hc)
        model.load_state_dict(to_hf_state(ours.state_dict(), cfg, "LxmertForPreTraining"))
        del ours
        call = lambda m, b: m(**hf_kwargs(b)).loss  # noqa: E731
    model.to(device).train()
    # The same optimiser for both; fused because that is what a CPU/GPU training run would pick.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    stepped = model
    if which == "ours" and compiled is not None:
        stepped = compile_model(model, mode=None if compiled == "default" else compiled)

    def step(batch: dict) -> torch.Tensor:
        # compiled as the trainer runs it: padded rows, shapes from the batch size alone
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16), static_layout(stepped is not model):
            loss = call(stepped, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return model, step


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_memory_child(
    which: str, batch: int, steps: int, device: str, bf16: bool, compiled: str | None
) -> None:
    cfg = LxmertConfig.preset("base")
    _, step = build(which, cfg, device, bf16, compiled)
    b = to_device(make_batch(cfg, batch, 20, 36), device)
    for _ in range(steps):
        step(b)
    synchronize(device)
    if device == "cuda":
        print(json.dumps({"peak_mb": torch.cuda.max_memory_allocated() / 2**20}))
        return
    # VmHWM (peak resident set) starts afresh at exec, unlike ru_maxrss which a forked child inherits.
    status = Path("/proc/self/status").read_text()
    hwm_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    print(json.dumps({"peak_mb": hwm_kb / 1024}))


def to_device(batch: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def add_step_options(ap: argparse.ArgumentParser, compiled: str) -> None:
    """--device, --bf16, --compile and --compile-mode: the options every training-step bench shares."""
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--bf16", action="store_true", help="both under torch.autocast(bfloat16)")
    ap.add_argument("--compile", action="store_true", help=compiled)
    ap.add_argument(
        "--compile-mode",
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        default="default",
        help="torch.compile mode with --compile (reduce-overhead: CUDA graphs)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 8, 2 timed steps each")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per implementation")
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    add_step_options(ap, compiled="xmodal's step compiled, as train.compile=on")
    ap.add_argument("--memory-child", choices=["ours", "hf"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    compiled = args.compile_mode if args.compile else None
    batch = args.batch or (8 if args.quick else 32)
    steps = args.steps or (2 if args.quick else 6)
    if args.memory_child:
        peak_memory_child(args.memory_child, batch, 3 if compiled else 1, args.device, args.bf16, compiled)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")

    cfg = LxmertConfig.preset("base")
    data = to_device(make_batch(cfg, batch, 20, 36), args.device)
    runners = {name: build(name, cfg, args.device, args.bf16, compiled)[1] for name in ("ours", "hf")}
    # Warm-up rounds: the first allocates AdamW's state (and compiles), the next let each side's
    # allocations settle after the other's (CUDA graphs record on their third call); the first round's
    # losses are reported (same weights, same batch).
    losses = {name: float(run(data)) for name, run in runners.items()}
    for _ in range(3 if compiled else 1):
        for run in runners.values():
            run(data)
    synchronize(args.device)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(steps):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run(data)
            synchronize(args.device)
            times[name].append(time.perf_counter() - t0)
    del runners
    for name, t in times.items():  # before the memory runs, so that a cut-off run still shows them
        print(f"{name} seconds per step: {', '.join(f'{x:.2f}' for x in t)}", file=sys.stderr, flush=True)

    peak = {}
    if not args.no_memory:
        for name in ("ours", "hf"):
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
            cmd += ["--compile", "--compile-mode", args.compile_mode] if compiled and name == "ours" else []
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            peak[name] = json.loads(out.strip().splitlines()[-1])["peak_mb"]

    rate = {name: len(t) / sum(t) for name, t in times.items()}
    ratio = rate["ours"] / rate["hf"]
    cuda = args.device == "cuda"
    precision = "bf16 autocast" if args.bf16 else "fp32"
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    memory = "peak_cuda_mb" if cuda else "peak_rss_mb"
    how = f"compiled ({compiled})" if compiled else "eager"
    print(f"LXMERT pre-training step, base config, batch {batch}, 20 tokens, 36 boxes, {precision}, "
          f"{where}, {steps} alternating steps, xmodal {how}")  # fmt: skip
    print(f"{'impl':<14}{'steps/s':>10}{'samples/s':>11}{'s/step':>10}{memory:>14}{'first loss':>12}")
    for name, label in (("ours", "xmodal"), ("hf", "transformers")):
        mem = f"{peak[name]:.0f}" if name in peak else "-"
        print(f"{label:<14}{rate[name]:>10.3f}{rate[name] * batch:>11.1f}{1 / rate[name]:>10.3f}{mem:>14}"
              f"{losses[name]:>12.4f}")  # fmt: skip
    print(f"ratio (xmodal / transformers steps/s): {ratio:.2f}")
    device = (
        where
        if cuda
        else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    )
    print(json.dumps({
        "name": "lxmert_pretrain_step", "device": device, "precision": precision,
        "batch": batch, "tokens": 20, "boxes": 36, "steps": steps, "compile": compiled or "off",
        "ours_steps_per_s": round(rate["ours"], 4), "hf_steps_per_s": round(rate["hf"], 4),
        "ours_samples_per_s": round(rate["ours"] * batch, 1),
        "hf_samples_per_s": round(rate["hf"] * batch, 1),
        f"ours_{memory}": round(peak.get("ours", 0)), f"hf_{memory}": round(peak.get("hf", 0)),
        "ours_loss": round(losses["ours"], 4), "hf_loss": round(losses["hf"], 4),
        "ours_step_s": [round(x, 4) for x in times["ours"]], "hf_step_s": [round(x, 4) for x in times["hf"]],
        "ratio": round(ratio, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
