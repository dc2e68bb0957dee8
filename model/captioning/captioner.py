"""What every captioner shares: the encoded image context, the step protocol and teacher forcing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import CaptionConfig

State = tuple[torch.Tensor, ...]


class Context(NamedTuple):
    """One image's regions prepared for decoding; every field has the batch first."""

    features: torch.Tensor  # (B, N, D)
    keys: torch.Tensor  # (B, N, A) the attention's projection of the features
    mask: torch.Tensor  # (B, N) bool, True = real region
    mean: torch.Tensor  # (B, D) mean over the real regions

    def select(self, index: torch.Tensor) -> Context:
        """Rows `index` of every field (beam expansion and reordering)."""
        return Context(*(field.index_select(0, index) for field in self))


class StepOutput(NamedTuple):
    logits: torch.Tensor  # (B, V) next-word logits
    state: State
    alpha: torch.Tensor  # (B, N) attention over the regions at this step


@dataclass
class CaptionOutput:
    """Teacher-forced outputs: per-step logits, the training loss and (optionally) attention over time."""

    logits: torch.Tensor  # (B, T, V)
    loss: torch.Tensor | None = None
    attentions: torch.Tensor | None = None  # (B, T, N)


def masked_mean(features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real regions of each image."""
    weights = mask.to(features.dtype).unsqueeze(-1)
    return (features * weights).sum(1) / weights.sum(1).clamp(min=1.0)


class Captioner(nn.Module):
    """An LSTM decoder attending over regions; subclasses define `init_state` and `step`."""

    config_class = CaptionConfig
    base_model_prefix = "captioner"

    def __init__(self, config: CaptionConfig):
        super().__init__()
        self.config = config

    attention: nn.Module

    def encode(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> Context:
        """features (B, N, D), mask (B, N) with 1 = real region (all real when omitted)."""
        if features.dim() != 3 or features.shape[-1] != self.config.feature_dim:
            raise ValueError(
                f"features must be (batch, regions, {self.config.feature_dim}); got {tuple(features.shape)}"
            )
        if mask is None:
            mask = torch.ones(features.shape[:2], dtype=torch.bool, device=features.device)
        mask = mask.bool()
        if not bool(mask.any(dim=1).all()):
            raise ValueError("every image needs at least one real region (a row of the mask is all zero)")
        return Context(features, self.attention.project(features), mask, masked_mean(features, mask))

    def init_state(self, ctx: Context) -> State:
        raise NotImplementedError

    def step(self, tokens: torch.Tensor, state: State, ctx: Context) -> StepOutput:
        """One decoding step from the previous words `tokens` (B,)."""
        raise NotImplementedError

    def forward(
        self,
        features: torch.Tensor,
        mask: torch.Tensor | None,
        captions: torch.Tensor,
        output_attentions: bool = False,
    ) -> CaptionOutput:
        """captions (B, T): `<bos> w… <eos> <pad>…`; predicts captions[:, 1:] from captions[:, :-1]."""
        ctx = self.encode(features, mask)
        logits, alphas = self.teacher_forced(ctx, captions[:, :-1])
        targets = captions[:, 1:]
        loss = self.word_loss(logits, targets) + self.attention_penalty(alphas, targets, ctx.mask)
        return CaptionOutput(logits, loss, alphas if output_attentions else None)

    def teacher_forced(self, ctx: Context, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) and attention (B, T, N) when fed the reference words."""
        state = self.init_state(ctx)
        logits, alphas = [], []
        for t in range(inputs.shape[1]):
            out = self.step(inputs[:, t], state, ctx)
            state = out.state
            logits.append(out.logits)
            alphas.append(out.alpha)
        return torch.stack(logits, 1), torch.stack(alphas, 1)

    def word_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy per real target word."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=self.config.pad_token_id)

    def attention_penalty(
        self, alphas: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """An extra attention term of the loss; none by default."""
        return alphas.new_zeros(())
