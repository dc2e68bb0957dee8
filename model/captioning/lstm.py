"""LSTM cell arithmetic on `nn.LSTMCell` weights, split so that teacher forcing projects its inputs once.

A step reads every weight; at small batches that memory traffic, not the arithmetic, is the cost. Inputs
known for all steps in advance (words, the mean feature) are projected in one matrix product over the
whole caption; the loop only multiplies what depends on the previous step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def input_gates(cell: nn.LSTMCell, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The gate pre-activations from input columns [start, stop) of `cell` for x (..., stop − start)."""
    return F.linear(x, cell.weight_ih[:, start:stop])


def recurrent_weight(cell: nn.LSTMCell, start: int, stop: int) -> torch.Tensor:
    """The weight multiplying [input columns [start, stop) ; h], for one product per step."""
    return torch.cat([cell.weight_ih[:, start:stop], cell.weight_hh], dim=1)


def cell_bias(cell: nn.LSTMCell) -> torch.Tensor:
    return cell.bias_ih + cell.bias_hh


def lstm_update(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, c) from the summed gate pre-activations, in `nn.LSTMCell`'s order: input, forget, cell, output."""
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c
