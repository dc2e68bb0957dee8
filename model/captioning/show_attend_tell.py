"""Show, Attend and Tell (Xu et al. 2015): an LSTM with soft or hard (REINFORCE) attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AdditiveAttention
from .captioner import Captioner, Context, State, StepOutput
from .config import CaptionConfig
from .lstm import cell_bias, input_gates, lstm_update, recurrent_weight


class ShowAttendTell(Captioner):
    """The decoder both attentions share: `z = β(h) · context`, initial h, c from the mean annotation."""

    def __init__(self, config: CaptionConfig):
        super().__init__(config)
        c = config
        self.embed = nn.Embedding(c.vocab_size, c.embed_size, padding_idx=c.pad_token_id)
        self.init_h = nn.Linear(c.visual_feat_dim, c.hidden_size)
        self.init_c = nn.Linear(c.visual_feat_dim, c.hidden_size)
        self.attention = AdditiveAttention(c.visual_feat_dim, c.hidden_size, c.attention_size)
        self.gate = nn.Linear(c.hidden_size, 1)
        self.lstm = nn.LSTMCell(c.embed_size + c.visual_feat_dim, c.hidden_size)
        # Deep output layer: L_o(E y_{t-1} + L_h h_t + L_z z_t).
        self.out_h = nn.Linear(c.hidden_size, c.embed_size)
        self.out_z = nn.Linear(c.visual_feat_dim, c.embed_size)
        self.dropout = nn.Dropout(c.dropout)
        self.output = nn.Linear(c.embed_size, c.vocab_size)

    def init_state(self, ctx: Context) -> State:
        return (torch.tanh(self.init_h(ctx.mean)), torch.tanh(self.init_c(ctx.mean)))

    def step(self, tokens: torch.Tensor, state: State, ctx: Context) -> StepOutput:
        """The expected context `β Σ αᵢaᵢ`: decoding uses it for both kinds, as arctic-captions does."""
        h, c = state
        alpha, z, _ = self._attend(h, ctx, sample=False)
        word = self.embed(tokens)
        h, c = self.lstm(torch.cat([word, z], dim=-1), (h, c))
        logits = self.output(self.dropout(word + self.out_h(h) + self.out_z(z)))
        return StepOutput(logits, (h, c), alpha)

    def unroll(self, ctx: Context, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, alphas, _ = self._unroll(ctx, inputs, sample=False)
        return logits, alphas

    def _unroll(
        self, ctx: Context, inputs: torch.Tensor, sample: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`step` over all words with the word gates and the deep output computed once for all steps;
        also log p(s_t) of each sampled location (B, T) when `sample`."""
        embed_size = self.config.embed_size
        words = self.embed(inputs)
        fixed = input_gates(self.lstm, words, 0, embed_size) + cell_bias(self.lstm)  # LSTM input: [word ; z]
        weight = recurrent_weight(self.lstm, embed_size, self.lstm.weight_ih.shape[1])  # [z ; h]
        h, c = self.init_state(ctx)
        hs, zs, alphas, log_ps = [], [], [], []
        for t in range(inputs.shape[1]):
            alpha, z, log_p = self._attend(h, ctx, sample)
            h, c = lstm_update(fixed[:, t] + F.linear(torch.cat([z, h], dim=-1), weight), c)
            hs.append(h)
            zs.append(z)
            alphas.append(alpha)
            log_ps.append(log_p)
        hidden, context = torch.stack(hs, 1), torch.stack(zs, 1)
        logits = self.output(self.dropout(words + self.out_h(hidden) + self.out_z(context)))
        return logits, torch.stack(alphas, 1), torch.stack(log_ps, 1) if sample else None

    def _attend(
        self, h: torch.Tensor, ctx: Context, sample: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """α, the gated context z, and log p(s) of the sampled location `s ~ α` when `sample`."""
        alpha = self.attention(h, ctx.keys, ctx.mask)
        if not sample:
            context = torch.bmm(alpha.unsqueeze(1), ctx.features).squeeze(1)
            return alpha, torch.sigmoid(self.gate(h)) * context, None
        location = torch.multinomial(alpha, 1)
        index = location.unsqueeze(-1).expand(-1, 1, ctx.features.shape[-1])
        context = ctx.features.gather(1, index).squeeze(1)
        log_p = torch.log(alpha.gather(1, location).squeeze(1))
        return alpha, torch.sigmoid(self.gate(h)) * context, log_p


class SoftAttentionCaptioner(ShowAttendTell):
    """Soft attention, trained with the doubly stochastic regularisation λ Σᵢ (1 − Σₜ αₜᵢ)²."""

    def attention_penalty(
        self, alphas: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Summed over real regions and real steps, averaged over images."""
        steps = (labels != self.config.pad_token_id).to(alphas.dtype).unsqueeze(-1)
        coverage = (alphas * steps).sum(1)
        penalty = ((1.0 - coverage) ** 2 * mask.to(alphas.dtype)).sum(1).mean()
        return self.config.doubly_stochastic_weight * penalty


class HardAttentionCaptioner(ShowAttendTell):
    """Hard attention: one sampled location per step, trained with REINFORCE (Xu et al. eq. 12)."""

    def __init__(self, config: CaptionConfig):
        super().__init__(config)
        # Moving average of log p(y | s, a): the REINFORCE baseline, saved with the weights for exact resume.
        self.register_buffer("baseline", torch.zeros(()))
        self.register_buffer("baseline_started", torch.zeros((), dtype=torch.bool))

    def teacher_forced(
        self, ctx: Context, inputs: torch.Tensor, labels: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """In training with labels, locations are sampled, except on a random part of the batches
        (`expected_attention_prob`, 0.5 as the paper) which use the expected α instead."""
        sampling = (
            self.training
            and labels is not None
            and float(torch.rand(())) >= self.config.expected_attention_prob
        )
        if not sampling:
            return super().teacher_forced(ctx, inputs, labels)
        return self._reinforce(ctx, inputs, labels)

    def _reinforce(
        self, ctx: Context, inputs: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Loss whose gradient is ∇log p(y|s) + λ_r (log p(y|s) − b) ∇log p(s) + λ_e ∇H[s]."""
        cfg = self.config
        real = (labels != cfg.pad_token_id).to(ctx.features.dtype)
        logits_t, alphas_t, log_p_locations = self._unroll(ctx, inputs, sample=True)
        log_p_words = -F.cross_entropy(
            logits_t.transpose(1, 2), labels, ignore_index=cfg.pad_token_id, reduction="none"
        )
        log_p_caption = (log_p_words * real).sum(1)
        log_p_sampled = (log_p_locations * real).sum(1)
        entropy = -(alphas_t * torch.log(alphas_t.clamp(min=1e-12))).sum(-1)
        entropy = (entropy * real).sum(1)
        with torch.no_grad():
            if not bool(self.baseline_started):
                # The first batch sets the baseline, so early advantages are not all of log p's size.
                self.baseline.copy_(log_p_caption.mean())
                self.baseline_started.fill_(True)
        advantage = (log_p_caption - self.baseline).detach()
        objective = (
            log_p_caption + cfg.reinforce_weight * advantage * log_p_sampled + cfg.entropy_weight * entropy
        )
        loss = -objective.sum() / real.sum().clamp(min=1.0)
        with torch.no_grad():
            self.baseline.mul_(cfg.baseline_decay).add_((1.0 - cfg.baseline_decay) * log_p_caption.mean())
        return logits_t, alphas_t, loss
