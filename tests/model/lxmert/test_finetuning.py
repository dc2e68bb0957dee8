"""The fine-tuning models: VQA/GQA answer scores and the NLVR2 image pair, with region attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import LxmertForNLVR2, LxmertForQuestionAnswering


@pytest.fixture(scope="module")
def cfg(lx):
    return lx.small_config()


def test_question_answering_loss_is_soft_score_bce_times_answers(cfg, lx):
    torch.manual_seed(3)
    model = LxmertForQuestionAnswering(cfg, num_answers=6).eval()
    inputs = lx.make_inputs(cfg)
    scores = torch.zeros(3, 6)
    scores[0, 2], scores[1, 4], scores[2, 1] = 1.0, 0.3, 0.9
    out = model(**inputs, labels=scores)
    assert out.logits.shape == (3, 6)
    x = out.logits
    bce = (torch.clamp(x, min=0) - x * scores + torch.log1p(torch.exp(-x.abs()))).sum() / 3
    torch.testing.assert_close(out.loss, bce, atol=1e-5, rtol=1e-5)


def test_nlvr2_pairs_one_sentence_with_both_images(cfg, lx):
    torch.manual_seed(4)
    model = LxmertForNLVR2(cfg).eval()
    inputs = lx.make_inputs(cfg, batch=4, boxes=5)
    text = {k: inputs[k][:2] for k in ("input_ids", "attention_mask", "token_type_ids")}
    feats = inputs["visual_feats"].view(2, 2, 5, -1)
    pos = inputs["visual_pos"].view(2, 2, 5, 4)
    vmask = inputs["visual_attention_mask"].view(2, 2, 5)
    labels = torch.tensor([1, 0])
    with torch.no_grad():
        out = model(**text, visual_feats=feats, visual_pos=pos, visual_attention_mask=vmask, labels=labels)
        pooled = []
        for i in range(2):
            sentence = {k: v[i : i + 1] for k, v in text.items()}
            for j in range(2):
                image = {"visual_feats": feats[i, j : j + 1], "visual_pos": pos[i, j : j + 1]}
                single = model.lxmert(**sentence, **image, visual_attention_mask=vmask[i, j : j + 1])
                pooled.append(single.pooled_output)
        expected = model.pair_head(torch.cat(pooled).view(2, -1))
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.loss, F.cross_entropy(expected, labels), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"\(B, 2, N, D\)"):
        model(**text, visual_feats=feats[:, 0], visual_pos=pos[:, 0])


def test_region_attention_is_cls_over_regions_in_the_last_cross_layer(cfg, lx):
    torch.manual_seed(5)
    qa = LxmertForQuestionAnswering(cfg, num_answers=6).eval()
    inputs = lx.make_inputs(cfg)
    with torch.no_grad():
        assert qa(**inputs).region_attention is None
        out = qa(**inputs, output_attentions=True)
        maps = qa.lxmert(**inputs, output_attentions=True).attentions
    expected = torch.stack([maps[-1][b, :, 0, :].mean(dim=0) for b in range(3)])  # `xmodal ask`'s reading
    torch.testing.assert_close(out.region_attention, expected)
    torch.testing.assert_close(out.region_attention.sum(-1), torch.ones(3))
    assert (out.region_attention[-1, -2:] == 0).all()  # padded boxes

    nlvr2 = LxmertForNLVR2(cfg).eval()
    pair = lx.make_inputs(cfg, batch=4)
    text = {k: pair[k][::2] for k in ("input_ids", "attention_mask", "token_type_ids")}
    images = {k: pair[k].view(2, 2, *pair[k].shape[1:]) for k in ("visual_feats", "visual_pos")}
    vmask = pair["visual_attention_mask"].view(2, 2, -1)
    with torch.no_grad():
        out = nlvr2(**text, **images, visual_attention_mask=vmask, output_attentions=True)
        i, j = 1, 1
        single = nlvr2.lxmert(
            **{k: v[i : i + 1] for k, v in text.items()},
            visual_feats=images["visual_feats"][i, j : j + 1],
            visual_pos=images["visual_pos"][i, j : j + 1],
            visual_attention_mask=vmask[i, j : j + 1],
            output_attentions=True,
        )
    assert out.region_attention.shape == (2, 2, 5)
    torch.testing.assert_close(
        out.region_attention[i, j], single.attentions[-1][0, :, 0, :].mean(dim=0), atol=1e-6, rtol=1e-5
    )
