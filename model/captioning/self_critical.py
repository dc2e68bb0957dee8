"""Self-critical sequence training (Rennie et al. 2017): REINFORCE with the greedy reward as baseline."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .captioner import Captioner
from .decoding import greedy, sample

# (tokens (R, L), image row of each caption (R,)) → reward of each caption (R,), e.g. CIDEr-D.
RewardFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class SelfCriticalOutput:
    loss: torch.Tensor
    sample_reward: torch.Tensor  # (B·S,) reward of each sampled caption
    greedy_reward: torch.Tensor  # (B,) reward of each image's greedy caption


def self_critical_loss(
    model: Captioner,
    features: torch.Tensor,
    mask: torch.Tensor | None,
    reward: RewardFn,
    samples_per_image: int = 1,
    generator: torch.Generator | None = None,
    suppress_unk: bool = True,
    max_length: int | None = None,
) -> SelfCriticalOutput:
    """−(r(wˢ) − r(ŵ)) Σₜ log p(wˢₜ), averaged over sampled tokens; ŵ is decoded greedily in eval mode
    (`<unk>` kept out of it with `suppress_unk`; self-critical.pytorch's greedy baseline allows it). Both
    run to `max_length` words (None: the model's `max_length`; self-critical.pytorch samples to its
    decoding length, 20, past the 16-word training captions)."""
    batch = features.shape[0]
    was_training = model.training
    model.eval()
    baseline_tokens = greedy(model, features, mask, max_length, suppress_unk=suppress_unk).tokens
    model.train(was_training)
    rows = torch.arange(batch, device=features.device).repeat_interleave(samples_per_image)
    drawn = sample(
        model,
        features.index_select(0, rows),
        None if mask is None else mask.index_select(0, rows),
        max_length,
        generator=generator,
    )
    with torch.no_grad():
        greedy_reward = reward(baseline_tokens, torch.arange(batch, device=features.device)).to(
            features.dtype
        )
        sample_reward = reward(drawn.tokens, rows).to(features.dtype)
    advantage = (sample_reward - greedy_reward.index_select(0, rows)).unsqueeze(1)
    tokens = drawn.mask.to(features.dtype)
    loss = -(advantage * drawn.logprobs * tokens).sum() / tokens.sum().clamp(min=1.0)
    return SelfCriticalOutput(loss, sample_reward, greedy_reward)
