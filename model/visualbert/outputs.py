"""What the one-stream heads return: a classification result and a pre-training result."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ClassificationOutput:
    """`region_attention` (B, N): the answer token's last-layer attention over the regions, mean over
    heads, when `output_attentions` was set (None for heads without one answer token)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    region_attention: torch.Tensor | None = None


@dataclass
class PreTrainingOutput:
    """`loss` is the sum of `losses` (0 without labels). With labels, `lm_logits` is (M, V) at the M
    labelled text positions and `region_logits` (K, C) at the K masked regions (row-major order);
    without any label they cover every position."""

    loss: torch.Tensor
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    lm_logits: torch.Tensor | None = None
    matched_logits: torch.Tensor | None = None
    region_logits: torch.Tensor | None = None
    text_output: torch.Tensor | None = None
    region_output: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
