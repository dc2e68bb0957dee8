"""What every family's task heads return, so that training and apps need not know the family."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ClassificationOutput:
    """`logits` (B, classes); `loss` when labels were given. With `output_attentions=True`: `attentions`,
    the family's own attention maps, and `region_attention`, the pooled token's attention over the image
    regions in the last layer that has one, mean over heads: (B, N), or (B, 2, N) for an image pair;
    0 at padded regions."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    region_attention: torch.Tensor | None = None
