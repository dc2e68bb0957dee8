"""Show, Attend and Tell's training terms: doubly stochastic regularisation and hard-attention REINFORCE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.captioning import CaptionConfig

from .conftest import make_caption_set
from .test_decoding import build


def test_doubly_stochastic_penalty_matches_the_formula():
    """loss = CE + λ Σᵢ (1 − Σₜ αₜᵢ)², summed over real regions and real steps, averaged over images."""
    model = build("sat-soft", doubly_stochastic_weight=0.7)
    data = make_caption_set(6)
    data.captions[0, -3:] = 0  # a shorter caption: its padded steps must not count
    with torch.no_grad():
        out = model(**data.inputs(), output_attentions=True)
    targets = data.captions[:, 1:]
    ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), targets.reshape(-1), ignore_index=0)
    penalty = 0.0
    for b in range(len(targets)):
        steps = [t for t in range(targets.shape[1]) if targets[b, t] != 0]
        for i in range(data.mask.shape[1]):
            if data.mask[b, i]:
                penalty += (1 - sum(float(out.attentions[b, t, i]) for t in steps)) ** 2
    expected = float(ce) + 0.7 * penalty / len(targets)
    assert float(out.loss) == pytest.approx(expected, rel=1e-5)


def test_hard_attention_with_expected_alpha_is_the_soft_word_loss():
    """With p = 1 of using the expected α, hard attention trains like soft attention without the penalty."""
    hard = build("sat-hard", expected_attention_prob=1.0).train()
    soft = build("sat-soft", doubly_stochastic_weight=0.0).train()
    data = make_caption_set(5)
    torch.testing.assert_close(hard(**data.inputs()).loss, soft(**data.inputs()).loss)
    assert float(hard.baseline) == 0.0  # no sampling happened, so the baseline did not move


def test_hard_attention_reinforce_gradient_and_baseline():
    """Sampled locations: the loss carries the REINFORCE term, and the baseline tracks log p(y | s)."""
    model = build("sat-hard", expected_attention_prob=0.0, entropy_weight=0.0, baseline_decay=0.5).train()
    data = make_caption_set(5)
    real = (data.captions[:, 1:] != 0).float()
    torch.manual_seed(1)
    out = model(**data.inputs())
    log_p = -F.cross_entropy(
        out.logits.detach().transpose(1, 2), data.captions[:, 1:], reduction="none", ignore_index=0
    )
    first = float((log_p * real).sum(1).mean())
    # The first batch sets the baseline, then a moving average with decay 0.5 follows.
    assert float(model.baseline) == pytest.approx(first, rel=1e-5)
    out.loss.backward()
    assert model.attention.score.weight.grad.abs().sum() > 0  # only log p(s) reaches the attention here
    torch.manual_seed(2)
    out = model(**data.inputs())
    log_p = -F.cross_entropy(
        out.logits.detach().transpose(1, 2), data.captions[:, 1:], reduction="none", ignore_index=0
    )
    second = float((log_p * real).sum(1).mean())
    assert float(model.baseline) == pytest.approx(0.5 * first + 0.5 * second, rel=1e-5)
    assert "baseline" in model.state_dict()


def test_config_presets_and_errors():
    updown = CaptionConfig.preset("updown")
    assert (updown.hidden_size, updown.attention_size, updown.embed_size) == (1000, 512, 1000)
    assert CaptionConfig.from_dict(updown.to_dict()) == updown
    with pytest.raises(ValueError, match="unknown CaptionConfig field"):
        CaptionConfig.preset("tiny", hidden=3)
    with pytest.raises(ValueError, match="distinct ids"):
        CaptionConfig.preset("sat", eos_token_id=0)
    with pytest.raises(ValueError, match="unknown captioning preset"):
        CaptionConfig.preset("huge")
