"""Fixtures for the VL-BERT tests: odd small sizes and padded inputs."""

from __future__ import annotations

import types

import pytest
import torch

from model.vlbert import VlBertConfig

# Odd sizes, so that a swapped dimension cannot go unnoticed.
SMALL = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "visual_feat_dim": 24,
    "geometry_dim": 16,
    "max_position_embeddings": 40,
    "num_region_classes": 11,
    "mask_token_id": 3,
    "sep_token_id": 2,
}


def small_config(**overrides) -> VlBertConfig:
    return VlBertConfig.preset("tiny", **{**SMALL, **overrides})


def make_inputs(cfg: VlBertConfig, batch: int = 3, tokens: int = 7, boxes: int = 5, seed: int = 0) -> dict:
    """Row 1 has 3 padding tokens, the last row 2 padding regions."""
    g = torch.Generator().manual_seed(seed)
    attention_mask = torch.ones(batch, tokens, dtype=torch.long)
    attention_mask[1, tokens - 3 :] = 0
    visual_attention_mask = torch.ones(batch, boxes, dtype=torch.long)
    visual_attention_mask[-1, boxes - 2 :] = 0
    corners = torch.rand(batch, boxes, 2, 2, generator=g).sort(dim=2).values  # x1 < x2, y1 < y2
    return {
        "input_ids": torch.randint(4, cfg.vocab_size, (batch, tokens), generator=g),
        "attention_mask": attention_mask,
        "token_type_ids": torch.zeros(batch, tokens, dtype=torch.long),
        "visual_feats": torch.randn(batch, boxes, cfg.visual_feat_dim, generator=g),
        "visual_pos": corners.transpose(2, 3).reshape(batch, boxes, 4),
        "visual_attention_mask": visual_attention_mask,
    }


def wake_visual_norms(model: torch.nn.Module) -> None:
    """Unit visual LayerNorm weights: they start at 0, which would hide the regions from every test."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual_ln" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="session")
def vl():
    return types.SimpleNamespace(small_config=small_config, make_inputs=make_inputs, wake=wake_visual_norms)
