"""detectron2's DefaultAnchorGenerator for one feature level: centred cells (offset 0), size-major order."""

from __future__ import annotations

import math

import torch
from torch import nn


def cell_anchors(sizes: tuple[float, ...], ratios: tuple[float, ...]) -> torch.Tensor:
    """(len(sizes) * len(ratios), 4) anchors centred on (0, 0); for each size, every ratio (h / w)."""
    anchors = []
    for size in sizes:
        area = size**2.0
        for ratio in ratios:
            w = math.sqrt(area / ratio)
            h = ratio * w
            anchors.append([-w / 2.0, -h / 2.0, w / 2.0, h / 2.0])
    return torch.tensor(anchors, dtype=torch.float32)


class AnchorGenerator(nn.Module):
    """Anchors of a (grid_h, grid_w) feature map, ordered (y, x, anchor) like the RPN's flattened outputs."""

    def __init__(
        self, sizes: tuple[float, ...], ratios: tuple[float, ...], stride: int = 16, offset: float = 0.0
    ):
        super().__init__()
        self.stride = stride
        self.offset = offset
        # not persistent: derived from the config; old detectron2 checkpoints may still carry it
        self.register_buffer("cell_anchors", cell_anchors(sizes, ratios), persistent=False)

    @property
    def num_anchors(self) -> int:
        return int(self.cell_anchors.shape[0])

    def forward(self, grid_h: int, grid_w: int) -> torch.Tensor:
        device = self.cell_anchors.device
        start = self.offset * self.stride
        shifts_x = torch.arange(
            start, grid_w * self.stride, step=self.stride, dtype=torch.float32, device=device
        )
        shifts_y = torch.arange(
            start, grid_h * self.stride, step=self.stride, dtype=torch.float32, device=device
        )
        shift_y, shift_x = torch.meshgrid(shifts_y, shifts_x, indexing="ij")
        shift_x, shift_y = shift_x.reshape(-1), shift_y.reshape(-1)
        shifts = torch.stack((shift_x, shift_y, shift_x, shift_y), dim=1)
        return (shifts.view(-1, 1, 4) + self.cell_anchors.view(1, -1, 4)).reshape(-1, 4)
