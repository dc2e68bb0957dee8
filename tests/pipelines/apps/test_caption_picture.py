"""The attention-over-time picture lights each word's attended region."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.apps.caption_picture import attention_heat, draw_caption_attention


def test_each_word_panel_is_lit_where_attended():
    image = np.full((60, 80, 3), 200, np.uint8)
    boxes = np.array([[0, 0, 40, 30], [40, 30, 80, 60]], np.float32)  # top-left, bottom-right quarters
    words = ["red", "ball", "left"]
    attn = np.array([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]], np.float32)
    picture = draw_caption_attention(image, boxes, (60, 80), words, attn)
    height, width = 224, 299  # enlarged so the shorter side is 224 px; each panel adds a 4 px margin
    panel_w = width + 8
    assert picture.shape == (4 + height + 28 + 4, 4 * panel_w, 3)  # one row: the caption and 3 words

    def quarter(panel: int, bottom_right: bool) -> float:
        x0, y0 = panel * panel_w + 4, 4
        ys = (
            slice(y0 + height // 2 + 8, y0 + height - 8)
            if bottom_right
            else slice(y0 + 8, y0 + height // 2 - 8)
        )
        xs = (
            slice(x0 + width // 2 + 8, x0 + width - 8) if bottom_right else slice(x0 + 8, x0 + width // 2 - 8)
        )
        return float(picture[ys, xs].mean())

    assert quarter(1, bottom_right=False) > 150 > quarter(1, bottom_right=True)  # "red": top-left
    assert quarter(2, bottom_right=True) > 150 > quarter(2, bottom_right=False)  # "ball": bottom-right
    assert quarter(0, True) == quarter(0, False) == 200.0  # the caption panel: the image as it is


def test_heat_sums_overlaps_and_scales():
    heat = attention_heat(np.array([[0, 0, 4, 4], [2, 2, 4, 4]]), np.array([0.25, 0.5]), 4, 4, (1.0, 1.0))
    assert heat[3, 3] == pytest.approx(1.0) and heat[0, 0] == pytest.approx(0.25 / 0.75)


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match="must be"):
        draw_caption_attention(
            np.zeros((8, 8, 3), np.uint8), np.zeros((2, 4)), (8, 8), ["a"], np.ones((1, 3))
        )
