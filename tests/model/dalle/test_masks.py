"""The joint-sequence attention masks against a brute-force reading of the paper's figure 11."""

from __future__ import annotations

import pytest
import torch

from model.dalle import attention_mask, layer_mask_kinds

TEXT, GRID = 3, 4


def reference(kind: str, text: int, grid: int, length: int, kernel: int) -> torch.Tensor:
    """Query q may see key k: never a later key; text sees all earlier text; an image token sees all
    text and, of the image, what its pattern allows (raster index i = row * grid + column)."""
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for q in range(length):
        for k in range(q + 1):
            if q < text or k < text:
                allowed[q, k] = True
                continue
            qi, ki = q - text, k - text
            (qr, qc), (kr, kc) = divmod(qi, grid), divmod(ki, grid)
            if kind == "dense":
                allowed[q, k] = True
            elif kind == "row":  # the previous grid + 1 tokens, itself included
                allowed[q, k] = qi - ki in range(grid + 1)
            elif kind == "column":
                allowed[q, k] = qc == kc
            elif kind == "conv":
                allowed[q, k] = qr - kr <= kernel // 2 and abs(qc - kc) <= kernel // 2
    return allowed


@pytest.mark.parametrize("kind", ["dense", "row", "column", "conv"])
@pytest.mark.parametrize("kernel", [1, 3])
def test_masks_match_the_brute_force_patterns(kind, kernel):
    length = TEXT + GRID * GRID - 1
    got = attention_mask(kind, TEXT, GRID, length, kernel)
    assert torch.equal(got, reference(kind, TEXT, GRID, length, kernel))


@pytest.mark.parametrize("kind", ["dense", "row", "column", "conv"])
def test_every_mask_is_causal_and_lets_each_position_see_itself_and_all_earlier_text(kind):
    length = TEXT + GRID * GRID
    mask = attention_mask(kind, TEXT, GRID, length, 3)
    assert not mask.triu(1).any()
    assert mask.diagonal().all()
    assert mask[TEXT:, :TEXT].all()


def test_row_mask_reaches_the_token_above_and_no_further():
    """Figure 11(a) at 4 x 4: the extent is grid + 1 = 5, the oldest key is one row up, same column."""
    mask = attention_mask("row", TEXT, GRID, TEXT + 16, 11)
    q = TEXT + 9  # row 2, column 1
    assert mask[q, TEXT + 5] and not mask[q, TEXT + 4]


def test_masks_of_a_prefix_are_the_prefix_of_the_mask():
    full = attention_mask("conv", TEXT, GRID, TEXT + 15, 3)
    assert torch.equal(attention_mask("conv", TEXT, GRID, 7, 3), full[:7, :7])


def test_layer_schedule_follows_the_paper():
    """Column attention in layers i with (i - 2) mod 4 = 0, row otherwise, convolutional in the last."""
    kinds = layer_mask_kinds("sparse", 64)
    assert kinds[-1] == "conv"
    assert [i + 1 for i, k in enumerate(kinds) if k == "column"] == list(range(2, 64, 4))
    assert kinds.count("row") == 64 - 16 - 1
    assert layer_mask_kinds("dense", 3) == ["dense"] * 3


def test_unknown_mask_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown attention mask 'diagonal'"):
        attention_mask("diagonal", TEXT, GRID, 5)
