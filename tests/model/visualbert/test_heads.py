"""VisualBERT's VQA and NLVR2 heads: parity with transformers' task classes, shapes, attention maps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.visualbert import VisualBertForNLVR2, VisualBertForQuestionAnswering

transformers = pytest.importorskip("transformers")


def test_question_answering_matches_transformers(vb):
    cfg = vb.small_config()
    torch.manual_seed(0)
    hf_cfg = vb.hf_config(cfg)
    hf_cfg.num_labels = 5
    hf = transformers.VisualBertForQuestionAnswering(hf_cfg).eval()
    vb.perturb(hf)
    ours = VisualBertForQuestionAnswering(cfg, num_answers=5).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    inputs = vb.make_inputs(cfg)
    labels = torch.softmax(torch.randn(3, 5), -1)
    with torch.no_grad():
        ref = hf(**vb.hf_inputs(inputs), labels=labels)
        ref_logits = hf(**vb.hf_inputs(inputs)).logits
        out = ours(**inputs, labels=labels, output_attentions=True)
    torch.testing.assert_close(out.logits, ref_logits, atol=1e-5, rtol=1e-5)
    # With labels transformers hands back the log-softmax; ours stay logits whatever is passed.
    torch.testing.assert_close(out.logits.log_softmax(-1), ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
    assert out.region_attention.shape == (3, 5)
    assert not out.region_attention[-1, -2:].any()  # padded regions get no weight
    assert torch.all(out.region_attention.sum(-1) <= 1 + 1e-6)


def test_nlvr2_reads_both_images(vb):
    cfg = vb.small_config()
    torch.manual_seed(0)
    model = VisualBertForNLVR2(cfg).eval()
    inputs = vb.make_inputs(cfg, batch=2)
    pair = {
        **inputs,
        "visual_feats": torch.randn(2, 2, 5, cfg.visual_feat_dim),
        "visual_pos": torch.rand(2, 2, 5, 4),
        "visual_attention_mask": torch.ones(2, 2, 5),
    }
    out = model(**pair, labels=torch.tensor([0, 1]))
    assert out.logits.shape == (2, 2) and out.loss.ndim == 0
    swapped = {**pair, "visual_feats": pair["visual_feats"].flip(1)}
    with torch.no_grad():
        # Image order matters (each image has its own visual token type), as "left"/"right" statements need.
        assert not torch.allclose(model(**pair).logits, model(**swapped).logits)
    pair["visual_attention_mask"][1, 0, -1] = 0
    with torch.no_grad():
        attention = model(**pair, output_attentions=True).region_attention
    assert attention.shape == (2, 2, 5) and attention[1, 0, -1] == 0 and (attention >= 0).all()
    with pytest.raises(ValueError, match=r"\(B, 2, N, D\)"):
        model(**inputs)


def test_nlvr2_layout_is_the_release_s(vb):
    """uclanlp/visualbert's NLVR2 input: both images' regions after the text, image 0's of visual token
    type 0 and image 1's of type 1, all at visual position 0; transformers' class fed that layout is the
    reference."""
    cfg = vb.small_config()
    torch.manual_seed(0)
    hf = transformers.VisualBertForVisualReasoning(vb.hf_config(cfg)).eval()
    vb.perturb(hf)
    with torch.no_grad():  # visual types and positions far apart, so a wrong one shows
        hf.visual_bert.embeddings.visual_token_type_embeddings.weight.normal_(0, 1)
        hf.visual_bert.embeddings.visual_position_embeddings.weight.normal_(0, 1)
    ours = VisualBertForNLVR2(cfg).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    inputs = vb.make_inputs(cfg, batch=2)
    feats = torch.randn(2, 2, 5, cfg.visual_feat_dim)
    mask = torch.ones(2, 2, 5, dtype=torch.long)
    mask[1, 1, -2:] = 0
    pair = {
        **inputs,
        "visual_feats": feats,
        "visual_pos": torch.rand(2, 2, 5, 4),
        "visual_attention_mask": mask,
    }
    hf_inputs = {
        "input_ids": inputs["input_ids"],
        "attention_mask": inputs["attention_mask"],
        "token_type_ids": inputs["token_type_ids"],
        "visual_embeds": feats.flatten(1, 2),
        "visual_attention_mask": mask.flatten(1, 2),
        "visual_token_type_ids": torch.tensor([[0] * 5 + [1] * 5] * 2),
    }
    with torch.no_grad():
        torch.testing.assert_close(ours(**pair).logits, hf(**hf_inputs).logits, atol=1e-5, rtol=1e-5)
        # another layout (type 1 for both images) reads differently
        other = hf(**hf_inputs | {"visual_token_type_ids": torch.ones(2, 10, dtype=torch.long)}).logits
        assert not torch.allclose(ours(**pair).logits, other, atol=1e-5, rtol=1e-5)


def test_tiny_model_learns_answers_from_the_regions(vb):
    """The answer is written into one random region's features: only the visual path can tell it."""
    torch.manual_seed(0)
    cfg = vb.small_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = VisualBertForQuestionAnswering(cfg, num_answers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch(n: int) -> tuple[dict, torch.Tensor]:
        inputs = vb.make_inputs(cfg, batch=n, tokens=5, boxes=3, seed=int(torch.randint(0, 10**6, ())))
        answers = torch.randint(0, 4, (n,))
        feats = torch.randn(n, 3, cfg.visual_feat_dim) * 0.1
        feats[torch.arange(n), torch.randint(0, 3, (n,)), :4] += 3 * F.one_hot(answers, 4)
        inputs |= {"visual_feats": feats, "visual_attention_mask": torch.ones(n, 3)}
        return inputs, answers

    for _ in range(60):
        inputs, answers = batch(16)
        loss = model(**inputs, labels=F.one_hot(answers, 4).float()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    inputs, answers = batch(200)
    with torch.no_grad():
        accuracy = (model(**inputs).logits.argmax(-1) == answers).float().mean()
    assert accuracy > 0.9  # chance is 0.25
