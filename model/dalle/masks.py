"""Attention masks over DALL-E's joint sequence: `text_length` text positions, then image tokens in
raster order. True = the query (row) may attend to the key (column).

Every mask is causal. Text queries see earlier text. Image queries see all text and, among image tokens,
earlier ones (the paper's appendix B.1, figure 11):
- dense: every earlier image token;
- row: the last `grid + 1` image tokens including itself, so the oldest is the same column one row up;
- column: earlier image tokens in its own column;
- conv: earlier image tokens within a `kernel` x `kernel` window centred on it (no wrap-around).
The paper uses column attention in layers i (1-based) with (i - 2) mod 4 = 0, row attention in the other
layers, and the convolutional mask in the last layer.
"""

from __future__ import annotations

import torch

MASK_KINDS = ("dense", "row", "column", "conv")


def attention_mask(kind: str, text_length: int, grid: int, length: int, kernel: int = 11) -> torch.Tensor:
    """(length, length) bool mask for the first `length` positions of text + grid * grid image tokens."""
    if kind not in MASK_KINDS:
        raise ValueError(f"unknown attention mask {kind!r}; choose one of {MASK_KINDS}")
    pos = torch.arange(length)
    q, k = pos[:, None], pos[None, :]
    causal = k <= q
    # Image raster indices (negative for text) and their rows and columns.
    qi, ki = q - text_length, k - text_length
    q_row, q_col = qi.div(grid, rounding_mode="floor"), qi.remainder(grid)
    k_row, k_col = ki.div(grid, rounding_mode="floor"), ki.remainder(grid)
    if kind == "dense":
        image_pattern = torch.ones(length, length, dtype=torch.bool)
    elif kind == "row":
        image_pattern = qi - ki <= grid
    elif kind == "column":
        image_pattern = q_col == k_col
    else:
        half = kernel // 2
        image_pattern = ((q_row - k_row) <= half) & ((q_col - k_col).abs() <= half)
    query_is_image, key_is_image = qi >= 0, ki >= 0
    # Only image-to-image pairs are restricted; text queries and text keys stay dense.
    restricted = query_is_image & key_is_image
    return causal & (~restricted | image_pattern)


def layer_mask_kinds(attention: str, num_layers: int) -> list[str]:
    """The mask of each layer: all dense, or the paper's sparse schedule."""
    if attention == "dense":
        return ["dense"] * num_layers
    kinds = ["column" if (i - 2) % 4 == 0 else "row" for i in range(1, num_layers + 1)]
    kinds[-1] = "conv"
    return kinds
