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


def release_boxes(boxes: torch.Tensor, image_size: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(whole-image box (B, 1, 4), region boxes (B, N, 4)) as the release's loaders give them, from boxes
    (B, N, 4) divided by the image size and image_size (B, 2) (width, height) in pixels.

    The release works in pixels: the image is the box [0, 0, w-1, h-1], region boxes are clamped to
    [0, w-1] x [0, h-1], and the geometry divides by (w, h); so here the whole image ends at
    ((w-1)/w, (h-1)/h) and regions are clamped there. Without sizes the image is [0, 0, 1, 1]."""
    b = boxes.shape[0]
    if image_size is None:
        return boxes.new_tensor([0.0, 0.0, 1.0, 1.0]).expand(b, 1, 4), boxes
    if image_size.shape != (b, 2):
        raise ValueError(f"image_size {tuple(image_size.shape)} should be (B={b}, 2) (width, height)")
    size = image_size.to(boxes.dtype)
    far = ((size - 1) / size).clamp(min=0).repeat(1, 2)[:, None]  # (B, 1, 4): x, y, x, y
    near = torch.zeros_like(far)
    whole = torch.cat([near[..., :2], far[..., 2:]], -1)
    return whole, torch.minimum(boxes.clamp(min=0), far)
