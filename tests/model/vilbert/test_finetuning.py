"""Fine-tuning heads: the release's head shapes and losses, the region attention, save and load."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from model.vilbert import (
    Vilbert,
    VilbertForNLVR2,
    VilbertForPreTraining,
    VilbertForQuestionAnswering,
    VilbertForRetrieval,
)


def _pairs(inputs: dict, k: int) -> dict:
    """The same text against k images: visual inputs (B, k, N, ·), image j of row i = row (i + j) % B."""
    b = inputs["input_ids"].shape[0]
    out = dict(inputs)
    for key in ("visual_feats", "visual_pos", "visual_attention_mask"):
        out[key] = torch.stack([inputs[key].roll(-j, dims=0) for j in range(k)], dim=1)
    assert out["visual_feats"].shape[:2] == (b, k)
    return out


def test_question_answering(vb):
    cfg = vb.small_config()
    model = vb.perturb(VilbertForQuestionAnswering(cfg, num_answers=6)).eval()
    head = model.vil_prediction.logit_fc
    assert [type(m).__name__ for m in head] == ["Linear", "GELU", "LayerNorm", "Linear"]
    assert (head[0].in_features, head[0].out_features, head[3].out_features) == (12, 24, 6)
    inputs = vb.make_inputs(cfg)
    labels = torch.rand(3, 6)
    with torch.no_grad():
        out = model(**inputs, labels=labels, output_attentions=True)
        pooled = model.bert(**inputs).pooled_output
    torch.testing.assert_close(out.logits, model.vil_prediction(pooled))
    torch.testing.assert_close(out.loss, F.binary_cross_entropy_with_logits(out.logits, labels) * 6)
    # [CLS]'s weights over the regions in the last co-attention layer, global token left out.
    t2v = out.attentions[-1][0]
    torch.testing.assert_close(out.region_attention, t2v[:, :, 0, 1:].mean(1))
    assert out.region_attention.shape == (3, 5)
    assert out.region_attention[-1, -2:].abs().max() == 0  # padding regions
    assert model(**inputs).region_attention is None


def test_nlvr2_concatenates_the_two_fused_outputs(vb):
    cfg = vb.small_config()
    model = vb.perturb(VilbertForNLVR2(cfg)).eval()
    inputs = _pairs(vb.make_inputs(cfg), 2)
    with torch.no_grad():
        out = model(**inputs, labels=torch.tensor([0, 1, 1]), output_attentions=True)
        flat = vb.make_inputs(cfg)
        f0 = model.bert(**flat).pooled_output
        f1 = model.bert(**{**flat, **{k: v.roll(-1, 0) for k, v in flat.items() if k.startswith("visual")}})
    torch.testing.assert_close(out.logits, model.vil_binary_prediction(torch.cat([f0, f1.pooled_output], -1)))
    assert out.region_attention.shape == (3, 2, 5)
    with pytest.raises(ValueError, match="two images"):
        model(**_pairs(vb.make_inputs(cfg), 3))
    with pytest.raises(ValueError, match=r"\(B, K, N, D\)"):
        model(**vb.make_inputs(cfg))


def test_retrieval_scores_each_pair(vb):
    cfg = vb.small_config()
    model = vb.perturb(VilbertForRetrieval(cfg)).eval()
    inputs = _pairs(vb.make_inputs(cfg), 3)
    labels = torch.tensor([0, 2, 1])
    with torch.no_grad():
        out = model(**inputs, labels=labels)
        first = model.vil_logit(model.bert(**vb.make_inputs(cfg)).pooled_output)[:, 0]
    assert out.logits.shape == (3, 3)
    torch.testing.assert_close(out.logits[:, 0], first)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels))


def test_any_class_loads_any_directory(vb, tmp_path, caplog):
    cfg = vb.small_config()
    pre = vb.perturb(VilbertForPreTraining(cfg)).eval()
    directory = pre.save_pretrained(tmp_path / "pre")
    assert {p.name for p in directory.iterdir()} == {"config.json", "model.safetensors"}
    again = VilbertForPreTraining.from_pretrained(directory)
    for k, v in pre.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k
    with caplog.at_level(logging.WARNING):
        qa = VilbertForQuestionAnswering.from_pretrained(directory, num_answers=4)
    assert "vil_prediction" in caplog.text
    backbone = Vilbert.from_pretrained(qa.save_pretrained(tmp_path / "qa"))
    for k, v in backbone.state_dict().items():
        assert torch.equal(pre.bert.state_dict()[k], v), k
    qa2 = VilbertForQuestionAnswering.from_pretrained(tmp_path / "qa", hidden_dropout_prob=0.3)
    assert qa2.num_answers == 4 and qa2.config.hidden_dropout_prob == 0.3
    assert torch.equal(qa2.vil_prediction.logit_fc[3].weight, qa.vil_prediction.logit_fc[3].weight)


def test_loading_refuses_another_config(vb, tmp_path):
    cfg = vb.small_config()
    VilbertForPreTraining(cfg).save_pretrained(tmp_path / "pre")
    with pytest.raises(ValueError, match="shapes differ"):
        Vilbert.from_pretrained(tmp_path / "pre", v_num_hidden_layers=2, v_intermediate_size=30)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        Vilbert.from_pretrained(tmp_path / "nothing")
