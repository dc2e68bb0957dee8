"""What the one-stream task heads return."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ClassificationOutput:
    """`region_attention` (B, N): the answer token's last-layer attention over the regions, mean over
    heads, when `output_attentions` was set (None for heads without one answer token)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    region_attention: torch.Tensor | None = None
