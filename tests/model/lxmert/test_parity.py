"""Parity with transformers' LXMERT: exact weight conversion both ways, equal outputs and losses."""

from __future__ import annotations

import pytest
import torch

from model import Lxmert, LxmertConfig, LxmertForPreTraining, LxmertForQuestionAnswering
from model.lxmert.convert import from_hf_state, to_hf_state

transformers = pytest.importorskip("transformers")
ATOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)


@pytest.fixture(scope="module", params=["small", "base"])
def pair(request, lx):
    """(config, transformers LxmertForPreTraining with random weights, ours converted from it), eval mode."""
    cfg = lx.small_config() if request.param == "small" else LxmertConfig.preset("base")
    torch.manual_seed(0)
    hf = transformers.LxmertForPreTraining(lx.hf_config(cfg)).eval()
    with torch.no_grad():  # non-trivial LayerNorm and bias values, so that a swapped one shows
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ours = LxmertForPreTraining(cfg).eval()
    ours.load_state_dict(from_hf_state(hf.state_dict(), cfg, "LxmertForPreTraining"), strict=True)
    return cfg, hf, ours


def test_state_dict_round_trip_is_exact(pair):
    cfg, hf, ours = pair
    reference = hf.state_dict()
    back = to_hf_state(ours.state_dict(), cfg, "LxmertForPreTraining")
    assert set(back) == set(reference)
    if cfg.hidden_size == 768:
        assert len(back) == 473
        assert sum(p.numel() for p in ours.parameters()) == 228_051_752
        assert sum(p.numel() for p in ours.lxmert.parameters()) == 207_936_768
    for key, value in reference.items():
        assert torch.equal(back[key], value), key


def test_outputs_and_every_head_match(pair, lx):
    cfg, hf, ours = pair
    inputs = lx.make_inputs(cfg, batch=2, tokens=6, boxes=4)
    with torch.no_grad():
        ref = hf(**inputs, output_attentions=True)
        ref_backbone = hf.lxmert(**inputs)
        ref_obj = hf.obj_predict_head(ref_backbone.vision_output)
        out = ours(**inputs, output_attentions=True)
    tokens, boxes = lx.real(inputs)
    assert not tokens.all() and not boxes.all()
    lx.close_where_real(out.language_output, ref_backbone.language_output, tokens)
    lx.close_where_real(out.vision_output, ref_backbone.vision_output, boxes)
    assert not out.language_output[~tokens].any() and not out.vision_output[~boxes].any()
    _close(out.pooled_output, ref_backbone.pooled_output)
    lx.close_where_real(out.lm_logits, ref.prediction_logits, tokens)
    _close(out.matched_logits, ref.cross_relationship_score)
    _close(out.answer_logits, ref.question_answering_score)
    lx.close_where_real(out.obj_logits, ref_obj["obj"], boxes)
    lx.close_where_real(out.attr_logits, ref_obj["attr"], boxes)
    lx.close_where_real(out.feat_pred, ref_obj["feat"], boxes)
    assert len(out.attentions) == cfg.x_layers
    for mine, theirs in zip(out.attentions, ref.cross_encoder_attentions, strict=True):
        # (B, heads, L, N): language queries at real tokens; padded boxes get no weight on either side.
        lx.close_where_real(mine.transpose(1, 2), theirs.transpose(1, 2), tokens)
        assert not mine[-1][..., ~boxes[-1]].any()


def test_backbone_matches_lxmert_model(pair, lx):
    cfg, hf, _ = pair
    if cfg.hidden_size == 768:
        pytest.skip("hf.lxmert is an LxmertModel: the base-size test above already compares it")
    reference = transformers.LxmertModel(hf.config).eval()
    reference.load_state_dict(hf.lxmert.state_dict())
    backbone = Lxmert(cfg).eval()
    backbone.load_state_dict(from_hf_state(reference.state_dict(), cfg, "Lxmert"), strict=True)
    inputs = lx.make_inputs(cfg, batch=2, tokens=6, boxes=4, seed=3)
    inputs["token_type_ids"] = None  # the default type is 0 on both sides
    with torch.no_grad():
        ref, out = reference(**inputs), backbone(**inputs)
    tokens, boxes = lx.real(inputs)
    lx.close_where_real(out.language_output, ref.language_output, tokens)
    lx.close_where_real(out.vision_output, ref.vision_output, boxes)
    _close(out.pooled_output, ref.pooled_output)


def test_losses_match(pair, lx):
    cfg, hf, ours = pair
    inputs = lx.make_inputs(cfg, batch=2, tokens=6, boxes=4)
    labels = lx.make_labels(cfg, inputs)
    with torch.no_grad():
        ref = hf(
            **inputs,
            labels=labels["lm_labels"],
            matched_label=labels["matched_labels"],
            obj_labels={
                "obj": (labels["obj_labels"], labels["obj_weights"]),
                "attr": (labels["attr_labels"], labels["attr_weights"]),
                "feat": (labels["feat_targets"], labels["feat_weights"]),
            },
            ans=labels["answer_labels"],
        )
        out = ours(**inputs, **labels)
    picked = labels["lm_labels"] != -100
    _close(out.lm_logits, ref.prediction_logits[picked])
    _close(out.loss, ref.loss)
    assert set(out.losses) == {"mlm", "matched", "obj", "attr", "feat", "qa"}


def test_gradients_match(pair, lx):
    """One backward through every loss gives transformers' gradient for every parameter: the
    padding-free layout, the tied MLM decoder and the CPU dropout's absence in eval mode all show here."""
    cfg, hf, ours = pair
    inputs = lx.make_inputs(cfg, batch=2, tokens=6, boxes=4)
    labels = lx.make_labels(cfg, inputs)
    hf.zero_grad(set_to_none=True)
    ours.zero_grad(set_to_none=True)
    hf(
        **inputs,
        labels=labels["lm_labels"],
        matched_label=labels["matched_labels"],
        obj_labels={
            k: (labels[f"{k}_labels" if k != "feat" else "feat_targets"], labels[f"{k}_weights"])
            for k in ("obj", "attr", "feat")
        },
        ans=labels["answer_labels"],
    ).loss.backward()
    ours(**inputs, **labels).loss.backward()
    theirs = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in hf.named_parameters()}
    expected = from_hf_state(theirs, cfg, "LxmertForPreTraining")
    for name, p in ours.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if name.endswith(("embeddings.position.weight", "embeddings.token_type.weight")):
            # transformers gives row 0 padding_idx, so [CLS]'s position and type 0 never learn there.
            assert grad[0].abs().sum() > 0 and not expected[name][0].any(), name
            grad, expected[name] = grad[1:], expected[name][1:]
        scale = expected[name].abs().max().clamp(min=1e-3)
        torch.testing.assert_close(grad / scale, expected[name] / scale, atol=2e-5, rtol=0, msg=name)


def test_question_answering_matches(pair, lx):
    cfg, hf, _ = pair
    if cfg.hidden_size == 768:
        pytest.skip("the head is the same module at every size; the small config covers it")
    reference = transformers.LxmertForQuestionAnswering(hf.config).eval()
    reference.lxmert.load_state_dict(hf.lxmert.state_dict())
    reference.answer_head.load_state_dict(hf.answer_head.state_dict())
    qa = LxmertForQuestionAnswering(cfg, num_answers=cfg.num_qa_labels).eval()
    qa.load_state_dict(from_hf_state(reference.state_dict(), cfg, "LxmertForQuestionAnswering"), strict=True)
    inputs = lx.make_inputs(cfg, batch=2, tokens=6, boxes=4)
    with torch.no_grad():
        _close(qa(**inputs).logits, reference(**inputs).question_answering_score)
