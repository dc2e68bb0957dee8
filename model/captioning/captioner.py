"""What every captioner shares: the encoded image context, the step protocol and teacher forcing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import static_layout_on
from ..pretrained import PretrainedMixin
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
    """Teacher-forced outputs: per-step next-word logits, the loss when labels were given, and with
    `output_attentions=True` the attention over regions at every step."""

    logits: torch.Tensor  # (B, T, V)
    loss: torch.Tensor | None = None
    attentions: torch.Tensor | None = None  # (B, T, N), 0 at padded regions


def masked_mean(features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the real regions of each image."""
    weights = mask.to(features.dtype).unsqueeze(-1)
    return (features * weights).sum(1) / weights.sum(1).clamp(min=1.0)


class Captioner(nn.Module, PretrainedMixin):
    """An LSTM decoder attending over regions; subclasses define `init_state` and `step`."""

    config_class = CaptionConfig
    base_model_prefix = ""
    attention: nn.Module

    def __init__(self, config: CaptionConfig):
        super().__init__()
        self.config = config

    def encode(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> Context:
        """features (B, N, D), mask (B, N) with 1 = real region (all real when omitted)."""
        if features.dim() != 3 or features.shape[-1] != self.config.visual_feat_dim:
            dim = self.config.visual_feat_dim
            raise ValueError(f"features must be (batch, regions, {dim}); got {tuple(features.shape)}")
        if mask is None:
            mask = torch.ones(features.shape[:2], dtype=torch.bool, device=features.device)
        mask = mask.bool()
        if not static_layout_on() and not bool(mask.any(dim=1).all()):  # no host sync when compiled
            raise ValueError("every image needs at least one real region (a row of the mask is all zero)")
        if self.config.normalize_features:
            features = F.layer_norm(features, features.shape[-1:])
        return Context(features, self.attention.project(features), mask, masked_mean(features, mask))

    def init_state(self, ctx: Context) -> State:
        raise NotImplementedError

    def step(self, tokens: torch.Tensor, state: State, ctx: Context) -> StepOutput:
        """One decoding step from the previous words `tokens` (B,)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        visual_feats: torch.Tensor | None = None,
        visual_pos: torch.Tensor | None = None,
        visual_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        labels: torch.Tensor | None = None,
        scheduled_sampling: float = 0.0,
    ) -> CaptionOutput:
        """Teacher forcing: step t reads word input_ids[:, t] and predicts labels[:, t] (`<pad>` ignored).

        The heads' shared signature; a caption's own `<pad>` ends it, so `attention_mask` and
        `token_type_ids` are not needed, and the regions' boxes (`visual_pos`) are not used by these models.
        `scheduled_sampling` > 0 in training: see `scheduled_unroll`.
        """
        if visual_feats is None:
            raise ValueError("a captioner needs visual_feats (batch, regions, features)")
        if not 0.0 <= scheduled_sampling <= 1.0:
            raise ValueError(f"scheduled_sampling {scheduled_sampling} must lie in [0, 1]")
        ctx = self.encode(visual_feats, visual_attention_mask)
        if scheduled_sampling > 0.0 and self.training:
            logits, alphas = self.scheduled_unroll(ctx, input_ids, scheduled_sampling)
            loss = None
            if labels is not None:
                loss = self.word_loss(logits, labels) + self.attention_penalty(alphas, labels, ctx.mask)
            return CaptionOutput(logits, loss, alphas if output_attentions else None)
        logits, alphas, loss = self.teacher_forced(ctx, input_ids, labels)
        return CaptionOutput(logits, loss, alphas if output_attentions else None)

    def scheduled_unroll(
        self, ctx: Context, inputs: torch.Tensor, prob: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing with scheduled sampling as self-critical.pytorch's `_forward`: from the second
        step on, each caption's input word is, with probability `prob`, drawn from the model's previous
        distribution (the draw carries no gradient) instead of the reference word."""
        state = self.init_state(ctx)
        logits: list[torch.Tensor] = []
        alphas: list[torch.Tensor] = []
        for t in range(inputs.shape[1]):
            tokens = inputs[:, t]
            if t >= 1:
                swap = torch.rand(tokens.shape[0], device=tokens.device) < prob
                if bool(swap.any()):
                    drawn = torch.multinomial(logits[-1].detach().float().softmax(-1), 1).squeeze(1)
                    tokens = torch.where(swap, drawn, tokens)
            out = self.step(tokens, state, ctx)
            state = out.state
            logits.append(out.logits)
            alphas.append(out.alpha)
        return torch.stack(logits, 1), torch.stack(alphas, 1)

    def teacher_forced(
        self, ctx: Context, inputs: torch.Tensor, labels: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V), attention (B, T, N) and the loss when fed the reference words."""
        logits_t, alphas_t = self.unroll(ctx, inputs)
        if labels is None:
            return logits_t, alphas_t, None
        loss = self.word_loss(logits_t, labels) + self.attention_penalty(alphas_t, labels, ctx.mask)
        return logits_t, alphas_t, loss

    def unroll(self, ctx: Context, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (B, T, V) and attention (B, T, N) of `step` applied to every input word in turn."""
        raise NotImplementedError

    def word_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy per real target word."""
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=self.config.pad_token_id)

    def attention_penalty(
        self, alphas: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """An extra attention term of the loss; none by default."""
        return alphas.new_zeros(())
