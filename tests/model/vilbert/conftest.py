"""Fixtures for the ViLBERT tests: a small config of odd sizes and padded random inputs."""

from __future__ import annotations

import types

import pytest
import torch

from model.vilbert import VilbertConfig

# Odd, distinct sizes so that a swapped dimension cannot go unnoticed.
SMALL = {
    "vocab_size": 97,
    "hidden_size": 24,
    "num_attention_heads": 3,
    "intermediate_size": 40,
    "num_hidden_layers": 3,
    "visual_feat_dim": 20,
    "v_hidden_size": 16,
    "v_num_attention_heads": 2,
    "v_intermediate_size": 28,
    "v_num_hidden_layers": 2,
    "bi_hidden_size": 12,
    "bi_num_attention_heads": 2,
    "v_biattention_id": [0, 1],
    "t_biattention_id": [1, 2],
    "v_target_size": 13,
}


def small_config(**overrides) -> VilbertConfig:
    return VilbertConfig.preset("tiny", **{**SMALL, **overrides})


def make_inputs(cfg: VilbertConfig, batch: int = 3, tokens: int = 7, boxes: int = 5, seed: int = 0) -> dict:
    """Row 1 has 3 padding tokens, the last row 2 padding regions."""
    g = torch.Generator().manual_seed(seed)
    attention_mask = torch.ones(batch, tokens, dtype=torch.long)
    attention_mask[1, tokens - 3 :] = 0
    visual_attention_mask = torch.ones(batch, boxes)
    visual_attention_mask[-1, boxes - 2 :] = 0
    xy = torch.rand(batch, boxes, 2, generator=g) * 0.5
    wh = torch.rand(batch, boxes, 2, generator=g) * 0.5
    return {
        "input_ids": torch.randint(1, cfg.vocab_size, (batch, tokens), generator=g),
        "attention_mask": attention_mask,
        "token_type_ids": torch.randint(0, 2, (batch, tokens), generator=g),
        "visual_feats": torch.randn(batch, boxes, cfg.visual_feat_dim, generator=g),
        "visual_pos": torch.cat([xy, xy + wh], dim=-1),
        "visual_attention_mask": visual_attention_mask,
    }


def perturb(model: torch.nn.Module, seed: int = 3, scale: float = 0.05) -> torch.nn.Module:
    """Moves every weight off its initial value so that zero biases and unit norms hide nothing."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


@pytest.fixture(scope="session")
def vb():
    """The helpers above, for test modules (pytest's importlib mode cannot import conftest directly)."""
    return types.SimpleNamespace(small_config=small_config, make_inputs=make_inputs, perturb=perturb)
