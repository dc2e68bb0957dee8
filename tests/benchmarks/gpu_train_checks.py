"""The compiled training path's checks that need a GPU (run by gpu_all.py): each prints one JSON line.

- bertadam: the list (foreach) update against the release's one-parameter-at-a-time step on CUDA: bits equal?
- compiled_vs_eager: inductor's forward + backward of a tiny preset (static layout, as the trainer runs
  it) against eager padding-free rows, float32 (TF32 off)
  and bf16 autocast: the loss's and the worst gradient's relative difference.
- trainer: `fit` with train.compile=on (inductor, fused AdamW) against off on the same batches.

    python tests/benchmarks/gpu_train_checks.py [--families lxmert vlbert]
    python tests/benchmarks/gpu_train_checks.py --device cpu --backend aot_eager --families lxmert  # dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model import FAMILIES  # noqa: E402
from model.layers.attention import static_layout  # noqa: E402
from pipelines.engine import compiled  # noqa: E402
from pipelines.engine.launch import fit  # noqa: E402
from pipelines.engine.optimizers import BertAdam  # noqa: E402
from pipelines.engine.trainer import TrainConfig  # noqa: E402

DEVICE = torch.device("cuda")


def bertadam_bits() -> dict:
    """The list update on CUDA against pytorch-pretrained-bert's BertAdam step written out one parameter at
    a time (its own gradient clipped to norm 1, `update += wd * p`, `p.add_(-(lr * update))`); ours with
    pytorch-pretrained-bert's `max_grad_norm` 1.0 (LXMERT's copy, our default, has no such clip)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(768, 768), (768,), (30522, 64), (3, 5)]
    start = [torch.randn(s, generator=gen).to(DEVICE) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    opt = BertAdam(ours, lr=1e-3, max_grad_norm=1.0)
    m = [torch.zeros_like(t) for t in theirs]
    v = [torch.zeros_like(t) for t in theirs]
    for lr in (1e-3, 2e-3, 5e-4, 1e-3, 3e-4):
        grads = [torch.randn(s, generator=gen).to(DEVICE) * 0.05 for s in shapes]
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        with torch.no_grad():
            for p, mi, vi in zip(theirs, m, v, strict=True):
                torch.nn.utils.clip_grad_norm_(p, 1.0)
                g = p.grad
                mi.mul_(0.9).add_(g, alpha=1 - 0.9)
                vi.mul_(0.999).addcmul_(g, g, value=1 - 0.999)
                update = mi / (vi.sqrt() + 1e-6)
                update += 0.01 * p.data
                p.data.add_(-(lr * update))
    pairs = [(a.detach(), b.detach()) for a, b in zip(ours, theirs, strict=True)]
    diffs = [float((a - b).abs().max()) for a, b in pairs]
    equal = all(torch.equal(a, b) for a, b in pairs)
    return {"name": "gpu_check_bertadam", "bitwise_equal": equal, "max_abs_diff": max(diffs)}


def _inputs(cfg, batch: int = 4, tokens: int = 12, regions: int = 8) -> dict:
    g = torch.Generator().manual_seed(0)
    corners = torch.rand(batch, regions, 2, 2, generator=g).sort(dim=-2).values
    text_mask = torch.ones(batch, tokens, dtype=torch.long)
    text_mask[0, -3:] = 0
    return {
        "input_ids": torch.randint(1, cfg.vocab_size, (batch, tokens), generator=g),
        "attention_mask": text_mask,
        "token_type_ids": torch.zeros(batch, tokens, dtype=torch.long),
        "visual_feats": torch.randn(batch, regions, cfg.visual_feat_dim, generator=g),
        "visual_pos": corners.transpose(-1, -2).flatten(-2),
        "visual_attention_mask": torch.ones(batch, regions),
    }


def compiled_vs_eager(family: str, bf16: bool) -> dict:
    torch.manual_seed(0)
    cfg = FAMILIES[family].config_class.preset("tiny")
    model = FAMILIES[family].models["backbone"](cfg).to(DEVICE).eval()
    inputs = {k: v.to(DEVICE) for k, v in _inputs(cfg).items()}

    def step(call):
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=bf16):
            out = call(**inputs)
        floats = [v for v in vars(out).values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        loss = sum(v.float().square().mean() for v in floats)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = step(model)
    start = time.perf_counter()
    with static_layout():  # as the trainer runs a compiled step
        got_loss, got = step(compiled.compile_model(model))
    seconds = time.perf_counter() - start
    worst = max(float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-12)) for n in want)
    return {
        "name": "gpu_check_compiled_vs_eager",
        "family": family,
        "precision": "bf16 autocast" if bf16 else "fp32 (TF32 off)",
        "loss_rel_diff": float((got_loss - want_loss).abs() / want_loss.abs().clamp_min(1e-12)),
        "worst_grad_rel_diff": worst,
        "same_gradients": sorted(got) == sorted(want),
        "first_call_s": round(seconds, 1),
    }


class _Points(torch.utils.data.Dataset):
    def __init__(self, n: int):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(n, 16)).astype(np.float32)
        self.y = (self.x @ rng.normal(size=16)).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class _Task:
    primary_metric = None

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))

    def train_dataset(self):
        return _Points(256)

    def valid_dataset(self):
        return None

    def collate(self, items, rng):
        return {
            "x": torch.from_numpy(np.stack([i[0] for i in items])),
            "y": torch.tensor([i[1] for i in items]),
        }

    def loss(self, model, batch):
        loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(-1).float(), batch["y"])
        return loss, {"mse": loss.detach()}

    def evaluate(self, model, loader):
        return {}

    def save(self, model, directory: Path) -> None:
        torch.save(model.state_dict(), directory / "toy.pt")


def trainer_compiled_vs_eager() -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setting in ("off", "on"):
            cfg = TrainConfig(
                lr=0.01,
                batch_size=32,
                epochs=2,
                log_every=4,
                loader_workers=0,
                trackers=[],
                compile=setting,
                device=DEVICE.type,
            )
            start = time.perf_counter()
            fit(_Task(), cfg, Path(tmp) / setting)
            out[setting] = (torch.load(Path(tmp) / setting / "last" / "toy.pt"), time.perf_counter() - start)
    worst = max(float((out["on"][0][k] - out["off"][0][k]).abs().max()) for k in out["off"][0])
    return {
        "name": "gpu_check_trainer_compile",
        "max_abs_weight_diff": worst,
        "eager_s": round(out["off"][1], 1),
        "compiled_s": round(out["on"][1], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["lxmert", "vlbert"])
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the checks themselves")
    ap.add_argument("--backend", default=compiled.BACKEND, help="torch.compile backend (dry run: aot_eager)")
    ap.add_argument("--only", nargs="+", choices=["bertadam", "compiled", "trainer"], help="only these")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    compiled.BACKEND = args.backend
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cases = [lambda f=f, b=b: compiled_vs_eager(f, b) for f in args.families for b in (False, True)]
    checks = [bertadam_bits, *cases[:2], trainer_compiled_vs_eager, *cases[2:]]  # the first family first
    if args.only:
        named = {"bertadam": [bertadam_bits], "compiled": cases, "trainer": [trainer_compiled_vs_eager]}
        checks = [c for name in args.only for c in named[name]]
    for check in checks:
        try:
            print(json.dumps(check()), flush=True)
        except Exception as exc:  # noqa: BLE001 - one check's failure is a result; the next still runs
            print(json.dumps({"name": "gpu_check_failed", "error": f"{type(exc).__name__}: {exc}"[:500]}))


if __name__ == "__main__":
    main()
