"""`VlBert` against the release's packed layout, written out independently per example."""

from __future__ import annotations

import pytest
import torch

from model.vlbert import VlBert
from model.vlbert.geometry import box_geometry


def packed_reference(model: VlBert, inputs: dict, row: int) -> torch.Tensor:
    """One example as the release lays it out: real text, the whole image, the real regions, [END],
    no padding at all; returns the encoder's states for that sequence."""
    cfg = model.config
    keep_text = inputs["attention_mask"][row].bool()
    keep_regions = inputs["visual_attention_mask"][row].bool()
    ids = inputs["input_ids"][row][keep_text]
    types = inputs["token_type_ids"][row][keep_text]
    feats = inputs["visual_feats"][row][keep_regions]
    boxes = inputs["visual_pos"][row][keep_regions]
    feats = torch.cat([feats.mean(0, keepdim=True), feats])
    boxes = torch.cat([torch.tensor([[0.0, 0.0, 1.0, 1.0]]), boxes])
    visual = model.obj_downsample(torch.cat([box_geometry(boxes, cfg.geometry_dim), feats], -1))
    t, k = ids.shape[0], feats.shape[0]
    text = model.word_embeddings(ids) + model.visual_ln_text(visual[0])
    objects = model.object_linguistic_embeddings.weight[0] + model.visual_ln_object(visual)
    x = torch.cat([text, objects, model.end_embedding.weight])
    positions = torch.cat([torch.arange(t), torch.full((k,), t), torch.tensor([t + 1])])
    segments = torch.cat([types, torch.full((k + 1,), 2)])
    x = model.embedding_LayerNorm(
        x + model.position_embeddings(positions) + model.token_type_embeddings(segments)
    )
    states, _ = model.encoder(x[None], None)
    return states[0]


def test_padded_batch_equals_the_packed_release_layout(vl):
    cfg = vl.small_config()
    torch.manual_seed(0)
    model = VlBert(cfg).eval()
    vl.wake(model)
    inputs = vl.make_inputs(cfg)
    inputs["token_type_ids"][0, 4:] = 1
    with torch.no_grad():
        out = model(**inputs)
        for row in range(3):
            ref = packed_reference(model, inputs, row)
            t = int(inputs["attention_mask"][row].sum())
            n = int(inputs["visual_attention_mask"][row].sum())
            torch.testing.assert_close(out.text_output[row, :t], ref[:t], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                out.region_output[row, :n], ref[t + 1 : t + 1 + n], atol=1e-5, rtol=1e-5
            )
            torch.testing.assert_close(out.sequence_output[row, -1], ref[-1], atol=1e-5, rtol=1e-5)


def test_regions_are_hidden_until_the_visual_norms_learn(vl):
    """The visual LayerNorms start at zero weight: a fresh model reads the text alone."""
    cfg = vl.small_config()
    model = VlBert(cfg).eval()
    inputs = vl.make_inputs(cfg)
    other = {**inputs, "visual_feats": torch.randn_like(inputs["visual_feats"])}
    with torch.no_grad():
        assert torch.equal(model(**inputs).text_output, model(**other).text_output)
        vl.wake(model)
        assert not torch.allclose(model(**inputs).text_output, model(**other).text_output)


def test_left_padding_and_wrong_widths_are_refused(vl):
    cfg = vl.small_config()
    model = VlBert(cfg)
    inputs = vl.make_inputs(cfg)
    left = {**inputs, "attention_mask": inputs["attention_mask"].flip(1)}
    with pytest.raises(ValueError, match="pad on the right"):
        model(**left)
    narrow = {**inputs, "visual_feats": inputs["visual_feats"][..., :5]}
    with pytest.raises(ValueError, match="visual_feat_dim=24"):
        model(**narrow)
    with pytest.raises(ValueError, match="visual_pos"):
        model(**{**inputs, "visual_pos": None})


def test_base_preset_sizes():
    from model.vlbert import VlBertConfig

    cfg = VlBertConfig.preset("base")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.type_vocab_size) == (768, 12, 3)
    assert cfg.geometry_dim + cfg.visual_feat_dim == 4096
