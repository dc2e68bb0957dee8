"""Fixtures for the VisualBERT tests: odd small sizes, padded inputs, transformers' model as the oracle."""

from __future__ import annotations

import types

import pytest
import torch

from model.visualbert import VisualBertConfig

# Odd sizes, so that a swapped dimension cannot go unnoticed.
SMALL = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "visual_feat_dim": 24,
    "max_position_embeddings": 40,
}


def small_config(**overrides) -> VisualBertConfig:
    return VisualBertConfig.preset("tiny", **{**SMALL, **overrides})


def make_inputs(
    cfg: VisualBertConfig, batch: int = 3, tokens: int = 7, boxes: int = 5, seed: int = 0, padded: bool = True
) -> dict:
    """Row 1 has 3 padding tokens, the last row 2 padding regions (when `padded`)."""
    g = torch.Generator().manual_seed(seed)
    attention_mask = torch.ones(batch, tokens, dtype=torch.long)
    visual_attention_mask = torch.ones(batch, boxes, dtype=torch.long)
    if padded:
        attention_mask[1, tokens - 3 :] = 0
        visual_attention_mask[-1, boxes - 2 :] = 0
    return {
        "input_ids": torch.randint(1, cfg.vocab_size, (batch, tokens), generator=g),
        "attention_mask": attention_mask,
        "token_type_ids": torch.randint(0, 2, (batch, tokens), generator=g),
        "visual_feats": torch.randn(batch, boxes, cfg.visual_feat_dim, generator=g),
        "visual_pos": torch.rand(batch, boxes, 4, generator=g),
        "visual_attention_mask": visual_attention_mask,
    }


def hf_config(cfg: VisualBertConfig):
    transformers = pytest.importorskip("transformers")
    values = cfg.to_dict()
    values["visual_embedding_dim"] = values.pop("visual_feat_dim")
    values.pop("visual_token_type_id", None)  # transformers' config has no such field (it feeds type 1)
    return transformers.VisualBertConfig(**values, hidden_act="gelu", attn_implementation="eager")


def hf_inputs(inputs: dict) -> dict:
    """Our shared-signature inputs under transformers' names (it takes no boxes)."""
    return {
        "input_ids": inputs["input_ids"],
        "attention_mask": inputs["attention_mask"],
        "token_type_ids": inputs["token_type_ids"],
        "visual_embeds": inputs["visual_feats"],
        "visual_attention_mask": inputs["visual_attention_mask"],
    }


def perturb(model: torch.nn.Module) -> None:
    """Non-trivial biases and LayerNorms, so that a swapped one shows."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.fixture(scope="session")
def vb():
    """The helpers above, for test modules (importlib mode cannot import a conftest directly)."""
    return types.SimpleNamespace(
        small_config=small_config,
        make_inputs=make_inputs,
        hf_config=hf_config,
        hf_inputs=hf_inputs,
        perturb=perturb,
    )
