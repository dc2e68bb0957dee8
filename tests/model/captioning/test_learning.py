"""Each captioner learns the generated captions: loss falls, CIDEr-D far above a constant caption."""

from __future__ import annotations

import time

import pytest
import torch

from model.captioning import beam_search, greedy
from pipelines.scoring.cider import CiderD

from .conftest import decode, make_caption_set
from .test_decoding import ARCHS, build


def train(model: torch.nn.Module, data, steps: int) -> list[float]:
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        out = model(**data.inputs())
        optimiser.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimiser.step()
        # The word loss alone: the doubly stochastic term has a floor when steps outnumber regions.
        losses.append(float(model.word_loss(out.logits.detach(), data.captions[:, 1:])))
    return losses


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_captioner_learns_generated_captions(arch):
    start = time.perf_counter()
    data = make_caption_set(48)
    model = build(arch)
    losses = train(model, data, steps=120)
    model.eval()
    cider = CiderD(data.references)
    constant = "a red cube left of a red cube"
    baseline, _ = cider.corpus_score({i: constant for i in data.references})
    learned, _ = cider.corpus_score(
        {i: decode(t) for i, t in enumerate(greedy(model, data.features, data.mask).tokens)}
    )
    beams = beam_search(model, data.features, data.mask, beam_size=3)
    beamed, _ = cider.corpus_score({i: decode(t) for i, t in enumerate(beams.best)})
    assert sum(losses[-10:]) < 0.5 * sum(losses[:10]), losses[::10]
    assert learned > baseline + 3.0, (learned, baseline)
    assert beamed > baseline + 3.0, (beamed, baseline)
    assert time.perf_counter() - start < 60
