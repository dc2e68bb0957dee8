"""Weight initialisation shared by the BERT-style families."""

from __future__ import annotations

from torch import nn


def init_weights(module: nn.Module, std: float) -> None:
    """BERT initialisation, for `module.apply`: normal(0, std) weights, zero biases, unit LayerNorm."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, 0.0, std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, std)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
