"""Benchmark: captioner training (cross-entropy and self-critical) and beam-search decoding on CPU.

Up-Down and Show-Attend-Tell (soft) at their published sizes (hidden 1000, attention 512, 2048-d
features, 36 regions) over a 10,000-word vocabulary, captions of 16 words. Training samples/s counts
images per second through forward, backward and Adam; SCST counts images per second through one
greedy decode (the baseline), one sampled caption, in-process CIDEr-D rewards against 5 references,
backward and Adam. Beam search counts captions per second at beam 3 and 5. Prints a table and one JSON line.

    OMP_NUM_THREADS=1 .venv/bin/python tests/benchmarks/bench_caption.py            # batch 8, 2 steps each
    OMP_NUM_THREADS=1 .venv/bin/python tests/benchmarks/bench_caption.py --quick    # batch 2, 1 step each
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.captioning import CaptionConfig, SoftAttentionCaptioner, UpDownCaptioner, beam_search  # noqa: E402
from model.captioning.self_critical import self_critical_loss  # noqa: E402
from pipelines.scoring.cider import CiderD  # noqa: E402

VOCAB, REGIONS, WORDS = 10000, 36, 16
ARCHS = {"updown": (UpDownCaptioner, "updown"), "sat-soft": (SoftAttentionCaptioner, "sat")}


def make_data(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, CiderD]:
    g = torch.Generator().manual_seed(seed)
    features = torch.rand(batch, REGIONS, 2048, generator=g)
    mask = torch.ones(batch, REGIONS, dtype=torch.bool)
    mask[::2, 30:] = False  # half the images have 30 regions, as variable-count detections would
    words = torch.randint(4, VOCAB, (batch, WORDS), generator=g)
    captions = torch.cat([torch.ones(batch, 1, dtype=torch.long), words, torch.full((batch, 1), 2)], 1)
    refs = {
        i: [" ".join(str(int(w)) for w in torch.randint(4, 300, (10,), generator=g)) for _ in range(5)]
        for i in range(batch)
    }
    return features, mask, captions, CiderD(refs)


def timed(fn, steps: int, warm_up: bool = False) -> float:
    if warm_up:
        fn()  # Adam's state and the allocator's first pass stay out of the timing
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def bench_arch(arch: str, batch: int, steps: int) -> dict[str, float]:
    cls, preset = ARCHS[arch]
    torch.manual_seed(0)
    model = cls(CaptionConfig.preset(preset, vocab_size=VOCAB))
    optimiser = torch.optim.Adam(model.parameters(), lr=5e-4)
    features, mask, captions, cider = make_data(batch)

    def reward(tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        texts = (" ".join(str(int(w)) for w in row if int(w) > 3) for row in tokens)
        return torch.from_numpy(cider.scores(zip(images.tolist(), texts, strict=True)))

    def xe_step() -> None:
        model.train()
        loss = model(
            input_ids=captions[:, :-1],
            visual_feats=features,
            visual_attention_mask=mask,
            labels=captions[:, 1:],
        ).loss
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()

    def scst_step() -> None:
        model.train()
        loss = self_critical_loss(model, features, mask, reward).loss
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()

    result = {
        "xe_samples_per_s": batch / timed(xe_step, steps),
        "scst_samples_per_s": batch / timed(scst_step, steps),
    }
    model.eval()
    for k in (3, 5):
        # Full-length captions: an untrained model rarely stops early, the worst case for decoding.
        result[f"beam{k}_captions_per_s"] = batch / timed(
            lambda k=k: beam_search(model, features, mask, k), steps
        )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 2, 1 timed step each")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    batch = args.batch or (2 if args.quick else 8)
    steps = args.steps or (1 if args.quick else 2)
    results = {arch: bench_arch(arch, batch, steps) for arch in ARCHS}
    load = os.getloadavg()[0]
    print(
        f"captioners, vocab {VOCAB}, {REGIONS} regions, {WORDS}-word captions, batch {batch}, fp32 CPU "
        f"({torch.get_num_threads()} threads, {platform.processor() or platform.machine()}), "
        f"load average {load:.2f}, {steps} timed steps"
    )
    columns = ("xe_samples_per_s", "scst_samples_per_s", "beam3_captions_per_s", "beam5_captions_per_s")
    print(f"{'arch':<10}" + "".join(f"{c:>22}" for c in columns))
    for arch, r in results.items():
        print(f"{arch:<10}" + "".join(f"{r[c]:>22.1f}" for c in columns))
    print(json.dumps({"bench": "caption", "batch": batch, "steps": steps, "load_average": load, **results}))


if __name__ == "__main__":
    main()
