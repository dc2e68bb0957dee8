"""VL-BERT's box geometry: sinusoids of the box centre and size, as its Fast R-CNN module embeds them."""

from __future__ import annotations

import torch


def box_geometry(boxes: torch.Tensor, dim: int) -> torch.Tensor:
    """boxes (..., 4) as (x1/W, y1/H, x2/W, y2/H) -> (..., dim).

    (xc, yc, w, h) x 100 are divided by 1000^(i / F), i < F = dim / 8, and the result is laid out per
    coordinate as [sin(F) ; cos(F)], coordinates in order, as the release lays its 2048 dimensions out.
    """
    x1, y1, x2, y2 = boxes.float().unbind(-1)
    coords = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], dim=-1) * 100
    freqs = dim // 8
    wavelengths = 1000 ** (torch.arange(freqs, dtype=torch.float32, device=boxes.device) / freqs)
    angles = coords[..., None] / wavelengths  # (..., 4, F)
    return torch.cat([angles.sin(), angles.cos()], dim=-1).flatten(-2).to(boxes.dtype)
