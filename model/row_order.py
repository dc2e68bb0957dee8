"""Classifier rows whose order differs between released checkpoints and xmodal, and the moves between them.

xmodal's matching heads score "the text belongs to the image" at index 1 (`matched_labels` 1 = matched);
vilbert-multi-task uses index 0, uclanlp/visualbert (and so the hub's VisualBERT weights) index 1. xmodal's
region-class heads follow the store's `class_probs`, background last (storage/FORMAT.md); the released
ViLBERT and VL-BERT heads put the background first. Converters move the rows so the numbers keep their
meaning, and exporters move them back.
"""

from __future__ import annotations

import torch

MATCHED_INDEX = 1  # xmodal's row (and label) for "the text belongs to the image"


def swap_match_rows(rows: torch.Tensor) -> torch.Tensor:
    """A two-way matching classifier's weight or bias with its rows swapped (the swap is its own inverse)."""
    if rows.shape[0] != 2:
        raise ValueError(f"a matching head has 2 rows, this one {rows.shape[0]}")
    return rows.flip(0).contiguous()


def background_last(rows: torch.Tensor) -> torch.Tensor:
    """Region-class rows of a background-first release in the store's order (background last)."""
    return torch.roll(rows, -1, dims=0).contiguous()


def background_first(rows: torch.Tensor) -> torch.Tensor:
    """Region-class rows in the store's order moved back to a background-first release's."""
    return torch.roll(rows, 1, dims=0).contiguous()
