"""`VisualBert` against transformers' `VisualBertModel`: equal outputs at a small and at the base size."""

from __future__ import annotations

import pytest
import torch

from model.visualbert import VisualBert, VisualBertConfig

transformers = pytest.importorskip("transformers")
ATOL = 1e-5


@pytest.fixture(scope="module", params=["small", "base"])
def pair(request, vb):
    """(config, transformers' VisualBertModel with random weights, ours with its state dict), eval mode."""
    cfg = vb.small_config() if request.param == "small" else VisualBertConfig.preset("base")
    torch.manual_seed(0)
    hf = transformers.VisualBertModel(vb.hf_config(cfg)).eval()
    vb.perturb(hf)
    ours = VisualBert(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return cfg, hf, ours


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_outputs_and_attentions_match_transformers(pair, vb, padded):
    cfg, hf, ours = pair
    inputs = vb.make_inputs(cfg, batch=2, tokens=6, boxes=4, padded=padded)
    if padded:
        inputs["attention_mask"][0, -2:] = 0  # the two rows pad text and regions differently
    with torch.no_grad():
        ref = hf(**vb.hf_inputs(inputs), output_attentions=True)
        out = ours(**inputs, output_attentions=True)
    _close(out.sequence_output, ref.last_hidden_state)
    _close(out.pooled_output, ref.pooler_output)
    assert out.text_output.shape[1] == 6 and out.region_output.shape[1] == 4
    assert len(out.attentions) == cfg.num_hidden_layers
    for mine, theirs in zip(out.attentions, ref.attentions, strict=True):
        _close(mine, theirs)


def test_key_names_are_transformers_names(pair):
    _, hf, ours = pair
    assert set(ours.state_dict()) == set(hf.state_dict())


def test_padding_does_not_change_real_outputs(vb):
    cfg = vb.small_config()
    torch.manual_seed(0)
    model = VisualBert(cfg).eval()
    inputs = vb.make_inputs(cfg, batch=1, tokens=5, boxes=3, padded=False)
    padded = dict(inputs)
    padded["input_ids"] = torch.cat([inputs["input_ids"], torch.tensor([[7, 8]])], 1)
    padded["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.tensor([[1, 1]])], 1)
    padded["attention_mask"] = torch.cat([inputs["attention_mask"], torch.zeros(1, 2, dtype=torch.long)], 1)
    padded["visual_feats"] = torch.cat([inputs["visual_feats"], torch.randn(1, 2, cfg.visual_feat_dim)], 1)
    padded["visual_pos"] = torch.cat([inputs["visual_pos"], torch.rand(1, 2, 4)], 1)
    padded["visual_attention_mask"] = torch.cat(
        [inputs["visual_attention_mask"], torch.zeros(1, 2, dtype=torch.long)], 1
    )
    with torch.no_grad():
        plain, more = model(**inputs), model(**padded)
    _close(more.text_output[:, :5], plain.text_output)
    _close(more.region_output[:, :3], plain.region_output)
    _close(more.pooled_output, plain.pooled_output)


def test_boxes_are_ignored(vb):
    cfg = vb.small_config()
    model = VisualBert(cfg).eval()
    inputs = vb.make_inputs(cfg)
    moved = {**inputs, "visual_pos": torch.rand_like(inputs["visual_pos"])}
    with torch.no_grad():
        assert torch.equal(model(**inputs).sequence_output, model(**moved).sequence_output)


def test_wrong_feature_width_is_named(vb):
    cfg = vb.small_config()
    inputs = vb.make_inputs(cfg)
    inputs["visual_feats"] = inputs["visual_feats"][..., :10]
    with pytest.raises(ValueError, match="visual_feat_dim=24"):
        VisualBert(cfg)(**inputs)


def test_special_visual_initialize_copies_text_tables(vb):
    emb = VisualBert(vb.small_config()).embeddings
    assert torch.equal(emb.visual_token_type_embeddings.weight, emb.token_type_embeddings.weight)
    assert torch.equal(emb.visual_position_embeddings.weight, emb.position_embeddings.weight)
