"""The masked-LM loss every family shares: cross-entropy at the labelled real positions, their mean."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .attention import static_layout_on


def masked_lm_loss(
    predict: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, loss): `predict` (rows (T, H) -> word logits) at the positions whose label is not -100
    and whose mask is 1, the summed cross-entropy over their number (0 when there are none).

    Eager, the head runs on those rows alone (~15 % of them); under `static_layout()` (a compiled step) on
    every row, with the others ignored, so the shapes follow the batch size without asking the device."""
    picked = labels != -100
    if attention_mask is not None:
        picked = picked & attention_mask.bool()
    if static_layout_on():
        logits = predict(hidden.flatten(0, 1))
        targets = labels.masked_fill(~picked, -100).flatten()
        summed = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        return logits, summed / picked.sum().clamp(min=1)
    targets = labels[picked]
    logits = predict(hidden[picked])
    summed = F.cross_entropy(logits, targets, reduction="sum")
    return logits, summed / max(targets.numel(), 1)
