"""The sinusoidal box geometry, against the release's layout written out by hand."""

from __future__ import annotations

import math

import torch

from model.vlbert.geometry import box_geometry


def test_layout_is_per_coordinate_sine_then_cosine():
    box = torch.tensor([[0.1, 0.2, 0.5, 0.6]])
    out = box_geometry(box, 16)  # 2 wavelengths: 1 and 1000^(1/2)
    assert out.shape == (1, 16)
    coords = [30.0, 40.0, 40.0, 40.0]  # (xc, yc, w, h) x 100
    expected = []
    for c in coords:
        angles = [c / 1000 ** (i / 2) for i in range(2)]
        expected += [math.sin(a) for a in angles] + [math.cos(a) for a in angles]
    torch.testing.assert_close(out[0], torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_base_width_and_batch_shape():
    assert box_geometry(torch.rand(2, 3, 4), 2048).shape == (2, 3, 2048)
