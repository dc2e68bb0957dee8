"""detectron2's anchor layout: centred cells, size-major, (y, x, anchor) order."""

from __future__ import annotations

import math

import torch

from extraction.anchors import AnchorGenerator


def test_cell_anchors_are_centred_and_size_major():
    gen = AnchorGenerator((64.0, 128.0, 256.0, 512.0), (0.5, 1.0, 2.0))
    cells = gen.cell_anchors
    assert cells.shape == (12, 4)
    for i, (size, ratio) in enumerate((s, r) for s in (64, 128, 256, 512) for r in (0.5, 1.0, 2.0)):
        w = math.sqrt(size * size / ratio)
        h = ratio * w
        torch.testing.assert_close(cells[i], torch.tensor([-w / 2, -h / 2, w / 2, h / 2]))


def test_grid_anchors_order_is_y_x_anchor():
    gen = AnchorGenerator((64.0, 128.0), (0.5, 1.0, 2.0))
    anchors = gen(2, 3)
    assert anchors.shape == (2 * 3 * 6, 4)
    for y in range(2):
        for x in range(3):
            for a in range(6):
                shift = torch.tensor([16.0 * x, 16.0 * y] * 2)
                torch.testing.assert_close(anchors[(y * 3 + x) * 6 + a], gen.cell_anchors[a] + shift)
