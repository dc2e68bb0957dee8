"""Box decoding and clipping, checked against detectron2's Box2BoxTransform formulas."""

from __future__ import annotations

import math

import torch

from extraction.box_coder import SCALE_CLAMP, BoxCoder, clip_boxes, nonempty


def test_decode_matches_the_formula_and_clamps_scale():
    box = torch.tensor([[10.0, 20.0, 50.0, 100.0]])  # w 40, h 80, centre (30, 60)
    deltas = torch.tensor([[1.0, -2.0, 0.5, 100.0]])
    out = BoxCoder((10.0, 10.0, 5.0, 5.0)).decode(deltas, box)[0]
    cx, cy = 30 + 0.1 * 40, 60 - 0.2 * 80
    w, h = math.exp(0.1) * 40, math.exp(SCALE_CLAMP) * 80  # dh = 20 is clamped to log(1000/16)
    torch.testing.assert_close(out, torch.tensor([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]))


def test_class_specific_decode_keeps_the_layout():
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 25.0, 15.0]])
    deltas = torch.randn(2, 3 * 4, generator=torch.Generator().manual_seed(0))
    coder = BoxCoder((10.0, 10.0, 5.0, 5.0))
    out = coder.decode(deltas, boxes)
    for c in range(3):
        torch.testing.assert_close(
            out[:, 4 * c : 4 * c + 4], coder.decode(deltas[:, 4 * c : 4 * c + 4], boxes)
        )


def test_clip_and_nonempty():
    boxes = torch.tensor([[-5.0, 2.0, 30.0, 50.0], [12.0, 3.0, 40.0, 3.0]])
    clipped = clip_boxes(boxes, 40, 20)
    assert clipped.tolist() == [[0.0, 2.0, 20.0, 40.0], [12.0, 3.0, 20.0, 3.0]]
    assert nonempty(clipped).tolist() == [True, False]
