"""Each captioner learns the generated captions: loss falls, CIDEr-D far above a constant caption, and
what it learned is read from the image (another image's regions make the captions unlikely)."""

from __future__ import annotations

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


@pytest.mark.slow  # 120 training steps per captioner: up to a minute or more on a busy 2-core machine
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_captioner_learns_generated_captions(arch):
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
    # grounded, not a language prior: each caption given another image's regions costs far more
    with torch.no_grad():
        own = float(model.word_loss(model(**data.inputs()).logits, data.captions[:, 1:]))
        swapped = {
            **data.inputs(),
            "visual_feats": data.features.roll(1, 0),
            "visual_attention_mask": data.mask.roll(1, 0),
        }
        other = float(model.word_loss(model(**swapped).logits, data.captions[:, 1:]))
    assert other > 2 * own + 0.1, (other, own)
