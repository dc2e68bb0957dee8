"""LxmertConfig: presets and the errors of a bad configuration."""

from __future__ import annotations

import pytest

from model import LxmertConfig


def test_presets_and_config_errors():
    base = LxmertConfig.preset("base")
    assert (base.hidden_size, base.num_attention_heads, base.intermediate_size) == (768, 12, 3072)
    assert (base.l_layers, base.r_layers, base.x_layers, base.vocab_size) == (9, 5, 5, 30522)
    assert (base.num_qa_labels, base.visual_feat_dim, base.layer_norm_eps) == (9500, 2048, 1e-12)
    tiny = LxmertConfig.preset("tiny", visual_feat_dim=16)
    assert tiny.hidden_size < base.hidden_size and tiny.visual_feat_dim == 16
    with pytest.raises(ValueError, match="unknown LXMERT preset"):
        LxmertConfig.preset("huge")
    with pytest.raises(ValueError, match="hidden_sise"):
        LxmertConfig.preset("tiny", hidden_sise=8)
    with pytest.raises(ValueError, match="multiple"):
        LxmertConfig.preset("tiny", num_attention_heads=3)
