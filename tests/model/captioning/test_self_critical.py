"""Self-critical training raises the CIDEr-D of greedy captions on the generated scenes."""

from __future__ import annotations

import torch

from model.captioning import greedy
from model.captioning.self_critical import self_critical_loss
from pipelines.scoring.cider import CiderD

from .conftest import decode, make_caption_set
from .test_decoding import build
from .test_learning import train


def cider_reward(cider: CiderD):
    def reward(tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(cider.scores(zip(images.tolist(), map(decode, tokens), strict=True)))

    return reward


def test_scst_raises_cider():
    data = make_caption_set(48)
    cider = CiderD(data.references)
    model = build("updown", seed=0)
    train(model, data, steps=16)  # a partly trained captioner, as SCST starts from cross-entropy

    def greedy_cider() -> float:
        model.eval()
        tokens = greedy(model, data.features, data.mask).tokens
        return cider.corpus_score({i: decode(t) for i, t in enumerate(tokens)})[0]

    before = greedy_cider()
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    sampled = []
    for _ in range(50):
        out = self_critical_loss(model, data.features, data.mask, cider_reward(cider), 5, generator)
        optimiser.zero_grad()
        out.loss.backward()
        optimiser.step()
        sampled.append(float(out.sample_reward.mean()))
    after = greedy_cider()
    assert after > before + 0.3, (before, after)
    assert sum(sampled[-10:]) > sum(sampled[:10]) + 5.0, sampled[::5]  # +0.5 CIDEr-D per sampled caption


def test_scst_loss_is_the_policy_gradient():
    """The gradient is −Σ (r(wˢ) − r(ŵ)) ∇log p(wˢ) / tokens: zero advantage gives zero loss."""
    data = make_caption_set(4)
    model = build("sat-soft").train()
    out = self_critical_loss(model, data.features, data.mask, lambda tokens, rows: torch.ones(len(rows)))
    assert float(out.loss.detach()) == 0.0
    assert out.sample_reward.shape == (4,) and out.greedy_reward.shape == (4,)
