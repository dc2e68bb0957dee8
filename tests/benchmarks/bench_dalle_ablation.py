"""Benchmark: where DALL-E's small preset loses the prompt, stage by stage, on the demo's scenes.

No detector: a fast loop for the tokenizer and the transformer settings (a GPU makes it minutes).

  tokenizer    small dVAE variants (the preset, the paper's relaxation, one change at a time): held-out PSNR,
               codebook entries used on 1000 scenes, and `colour kept`: the fraction of test objects whose
               colour survives the round trip (median of the object's centre patch, nearest of the scene
               palette's 4 shape and 3 background colours; 1.0 on the real scenes by construction)
  transformer  small transformer on the chosen dVAE's grids: held-out image-token loss after the right
               caption and after another scene's caption (the caption gain: does it read the text?)

Prints a table and one JSON line (`ratio` = colour kept by the small preset / by the paper's relaxation
at the same steps, >1 better; null when the paper's keeps none).

    OMP_NUM_THREADS=2 .venv/bin/python tests/benchmarks/bench_dalle_ablation.py --scenes 3000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from model.dalle import DalleConfig, DalleTransformer, DiscreteVAE, DVAEConfig  # noqa: E402
from pipelines.apps.demo.synthetic import BACKGROUNDS, COLOURS, SyntheticConfig, generate  # noqa: E402
from pipelines.tasks.generation import psnr  # noqa: E402

# name -> (steps, DVAEConfig overrides, lr): the small preset (a softmax annealed to one-hot, logits x 10,
# squared error, no KL term), the same with unscaled logits and with the Gumbel noise, and the paper's
# relaxation (Gumbel noise, unscaled logits, logit-Laplace, KL weight 1) at the same 600 steps
PAPER_RELAXATION = {
    "gumbel_noise": 1.0,
    "logit_scale": 1.0,
    "reconstruction_loss": "logit-laplace",
    "kl_weight": 1.0,
}
TOKENIZERS = {
    "preset-600": (600, {}, 2e-3),
    "preset-600-logits-x1": (600, {"logit_scale": 1.0}, 2e-3),
    "preset-600-gumbel-noise": (600, {"gumbel_noise": 1.0}, 2e-3),
    "paper-relaxation-600": (600, PAPER_RELAXATION, 2e-3),
}
PALETTE_NAMES = list(COLOURS) + [f"bg-{k}" for k in BACKGROUNDS]
PALETTE = np.array(list(COLOURS.values()) + list(BACKGROUNDS.values()), dtype=np.float64)


def cosine_lr(step: int, steps: int, base: float) -> float:
    return base * min(1.0, (step + 1) / max(1, steps // 50)) * 0.5 * (1 + math.cos(math.pi * step / steps))


def colour_kept(images: np.ndarray, objects: list[list[tuple]]) -> float:
    """Fraction of objects whose centre patch is nearest to their own colour."""
    ok = n = 0
    for picture, shapes in zip(images, objects, strict=True):
        for colour, kind, (x1, y1, x2, y2) in shapes:
            cx, cy = (x1 + x2) / 2, y1 + (y2 - y1) * (0.65 if kind == "triangle" else 0.5)
            r = max(1, int(min(x2 - x1, y2 - y1) * 0.15))
            patch = picture[int(cy) - r : int(cy) + r + 1, int(cx) - r : int(cx) + r + 1].reshape(-1, 3)
            median = np.median(patch.astype(np.float64), 0)
            ok += PALETTE_NAMES[int(((PALETTE - median) ** 2).sum(1).argmin())] == colour
            n += 1
    return ok / n


def to_uint8(x: torch.Tensor) -> np.ndarray:
    return (x.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()


def train_tokenizer(x: torch.Tensor, steps: int, over: dict, lr: float, device: str) -> DiscreteVAE:
    torch.manual_seed(0)
    dvae = DiscreteVAE(DVAEConfig.preset("small", **over)).to(device)
    opt = torch.optim.AdamW(dvae.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, lr)
        temperature, kl_weight = dvae.schedule(step)
        idx = torch.randint(0, len(x), (16,), generator=g).to(device)
        loss = dvae(x[idx], temperature, kl_weight).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return dvae.eval()


def caption_gain(
    grids: torch.Tensor, captions: list[list[str]], train: list[int], test: list[int], steps: int, device: str
) -> tuple[float, float]:
    """Held-out image-token loss after the right and after the next scene's caption (both captions of each
    training scene are pairs, as `xmodal generate train` makes them)."""
    words = sorted({w for i in train for c in captions[i] for w in c.lower().replace(".", " ").split()})
    ids = {w: k + 3 for k, w in enumerate(words)}  # 0 start, 1 end, 2 unknown
    cfg = DalleConfig.preset(
        "small", text_vocab_size=len(ids) + 3, image_vocab_size=int(grids.max()) + 1, image_grid=8
    )
    length = cfg.text_length

    def encode(items: list[str]) -> torch.Tensor:
        text = np.zeros((len(items), length), np.int64)
        padding = np.ones((len(items), length), bool)
        for row, c in enumerate(items):
            seq = [0] + [ids.get(w, 2) for w in c.lower().replace(".", " ").split()][: length - 2] + [1]
            text[row, : len(seq)], padding[row, : len(seq)] = seq, False
        return model.pad_text(torch.from_numpy(text), torch.from_numpy(padding)).to(device)

    torch.manual_seed(0)
    model = DalleTransformer(cfg).to(device)
    pairs = [(i, c) for i in train for c in captions[i]]
    text, image = encode([c for _, c in pairs]), grids[[i for i, _ in pairs]]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, 1e-3) if steps >= 20 else 1e-3
        idx = torch.randint(0, len(pairs), (32,), generator=g).to(device)
        loss = model.loss(text[idx], image[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    held = encode([captions[i][0] for i in test])
    with torch.no_grad():
        right = float(model.loss(held, grids[test]).image)
        wrong = float(model.loss(held.roll(1, 0), grids[test]).image)
    return right, wrong


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenes", type=int, default=3000)
    p.add_argument("--only", nargs="*", default=None, help="tokenizer variants to run (default: all)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every step count (a quick look: 0.01)")
    p.add_argument("--transformer-steps", type=int, default=1500)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = generate(Path(tmp), SyntheticConfig(num_images=args.scenes, image_size=64, seed=1))
        rows = json.loads(data.captions.read_text())["images"]
        scenes = {s["img_id"]: s for s in json.loads(data.scenes.read_text())}
        pictures = np.stack(
            [np.asarray(Image.open(data.images_dir / r["filename"]).convert("RGB")) for r in rows]
        )
    captions = [[s["raw"] for s in r["sentences"]] for r in rows]
    objects = [
        [(s["colour"], s["shape"], tuple(s["box"])) for s in scenes[Path(r["filename"]).stem]["shapes"]]
        for r in rows
    ]
    train = [i for i, r in enumerate(rows) if r["split"] == "train"]
    test = [i for i, r in enumerate(rows) if r["split"] == "test"]
    held = [i for i in range(len(rows)) if i % 20 == 19]  # `train-tokenizer`'s held-out rule
    fitted = [i for i in range(len(rows)) if i % 20 != 19]
    x = torch.from_numpy(pictures).permute(0, 3, 1, 2).float().div(255).to(args.device)
    results, dvaes = {}, {}
    real = colour_kept(pictures[test], [objects[i] for i in test])
    for name, (steps, over, lr) in TOKENIZERS.items():
        if args.only and name not in args.only:
            continue
        steps = max(2, round(steps * args.scale))
        start = time.perf_counter()
        dvae = dvaes[name] = train_tokenizer(x[fitted], steps, over, lr, args.device)
        with torch.no_grad():
            db = float(psnr(x[held], dvae.decode(dvae.encode(x[held]))).mean())
            codes = len(dvae.encode(x[:1000]).unique())
            kept = colour_kept(to_uint8(dvae.decode(dvae.encode(x[test]))), [objects[i] for i in test])
        seconds = round(time.perf_counter() - start, 1)
        results[name] = {
            "steps": steps, "psnr_db": round(db, 2), "codes_used": codes, "colour_kept": round(kept, 3),
            "seconds": seconds,
        }  # fmt: skip
    best = max(results, key=lambda k: results[k]["colour_kept"])
    with torch.no_grad():
        grids = torch.cat([dvaes[best].encode(x[i : i + 500]) for i in range(0, len(x), 500)]).flatten(1)
    steps = max(2, round(args.transformer_steps * args.scale))
    right, wrong = caption_gain(grids, captions, train, test, steps, args.device)
    load = os.getloadavg()
    print(f"{'tokenizer':22s} {'steps':>6s} {'PSNR dB':>8s} {'codes':>6s} {'colour kept':>12s} {'s':>6s}")
    print(f"{'(real scenes)':22s} {'':>6s} {'':>8s} {'':>6s} {real:12.3f}")
    for name, r in results.items():
        print(
            f"{name:22s} {r['steps']:6d} {r['psnr_db']:8.2f} {r['codes_used']:6d} {r['colour_kept']:12.3f} "
            f"{r['seconds']:6.1f}"
        )
    print(f"transformer on {best}: {steps} steps, held-out image-token loss {right:.3f} after the right "
          f"caption, {wrong:.3f} after another (gain {wrong - right:.3f} nats)")  # fmt: skip
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs")
    base = results.get("paper-relaxation-600", {}).get("colour_kept")
    ours = results.get("preset-600", {}).get("colour_kept")
    line = {
        "name": "dalle_small_ablation",
        "device": args.device
        if args.device != "cpu"
        else f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "scenes": args.scenes,
        "real_colour_kept": round(real, 3),
        "tokenizers": results,
        "best": best,
        "transformer_steps": steps,
        "image_loss_right_caption": round(right, 4),
        "image_loss_other_caption": round(wrong, 4),
        "loadavg": [round(v, 2) for v in load],
        "ratio": round(ours / base, 2) if base and ours is not None else None,
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
