"""Fixtures for the LXMERT tests: small configs, random inputs, and transformers' model as the reference."""

from __future__ import annotations

import pytest
import torch

from model import LxmertConfig

# Deliberately odd sizes so that a swapped dimension cannot go unnoticed.
SMALL = {
    "vocab_size": 99,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "l_layers": 2,
    "r_layers": 2,
    "x_layers": 2,
    "visual_feat_dim": 24,
    "num_object_labels": 11,
    "num_attr_labels": 7,
    "num_qa_labels": 5,
}
HF_FIELDS = (*SMALL, "max_position_embeddings", "type_vocab_size")


def small_config(**overrides) -> LxmertConfig:
    return LxmertConfig.preset("tiny", **{**SMALL, **overrides})


def make_inputs(cfg: LxmertConfig, batch: int = 3, tokens: int = 7, boxes: int = 5, seed: int = 0) -> dict:
    """Padded text (row 1 has 3 padding tokens) and variable boxes (row 2 has 2 padding boxes)."""
    g = torch.Generator().manual_seed(seed)
    attention_mask = torch.ones(batch, tokens, dtype=torch.long)
    attention_mask[1, tokens - 3 :] = 0
    visual_attention_mask = torch.ones(batch, boxes)
    visual_attention_mask[-1, boxes - 2 :] = 0
    return {
        "input_ids": torch.randint(1, cfg.vocab_size, (batch, tokens), generator=g),
        "attention_mask": attention_mask,
        "token_type_ids": torch.randint(0, 2, (batch, tokens), generator=g),
        "visual_feats": torch.randn(batch, boxes, cfg.visual_feat_dim, generator=g),
        "visual_pos": torch.rand(batch, boxes, 4, generator=g),
        "visual_attention_mask": visual_attention_mask,
    }


def make_labels(cfg: LxmertConfig, inputs: dict, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    b, n = inputs["visual_feats"].shape[:2]
    boxes = inputs["visual_attention_mask"].float()  # weights only on real boxes, as a data pipeline gives
    lm = torch.full_like(inputs["input_ids"], -100)
    lm[:, 1] = torch.randint(0, cfg.vocab_size, (b,), generator=g)
    lm[0, 3] = 5
    answers = torch.randint(0, cfg.num_qa_labels, (b,), generator=g)
    answers[0] = -100
    return {
        "lm_labels": lm,
        "matched_labels": torch.tensor([1, 0, 1][:b]),
        "obj_labels": torch.randint(0, cfg.num_object_labels, (b, n), generator=g),
        "obj_weights": torch.rand(b, n, generator=g) * boxes,
        "attr_labels": torch.randint(0, cfg.num_attr_labels, (b, n), generator=g),
        "attr_weights": torch.rand(b, n, generator=g) * boxes,
        "feat_targets": torch.randn(b, n, cfg.visual_feat_dim, generator=g),
        "feat_weights": (torch.rand(b, n, generator=g) < 0.5).float() * boxes,
        "answer_labels": answers,
    }


def real(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean (B, L) real tokens and (B, N) real boxes of a batch."""
    return inputs["attention_mask"].bool(), inputs["visual_attention_mask"].bool()


def close_where_real(
    mine: torch.Tensor, theirs: torch.Tensor, real: torch.Tensor, atol: float = 1e-5
) -> None:
    """Equal at the real positions (the leading (B, S) dims); transformers' values at the padding are
    whatever its layers made of padding, which xmodal does not compute."""
    assert mine.shape == theirs.shape
    torch.testing.assert_close(mine[real], theirs[real], atol=atol, rtol=1e-5)


def hf_config(cfg: LxmertConfig):
    transformers = pytest.importorskip("transformers")
    return transformers.LxmertConfig(
        **{k: getattr(cfg, k) for k in HF_FIELDS}, visual_loss_normalizer=cfg.visual_loss_scale
    )


@pytest.fixture(scope="session")
def lx():
    """The helpers above, for test modules (pytest's importlib mode cannot import conftest directly)."""
    import types

    return types.SimpleNamespace(
        small_config=small_config,
        make_inputs=make_inputs,
        make_labels=make_labels,
        hf_config=hf_config,
        real=real,
        close_where_real=close_where_real,
    )
