"""Behaviour of the LXMERT model: masking, losses, gradients, fine-tuning heads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import Lxmert, LxmertConfig, LxmertForNLVR2, LxmertForPreTraining, LxmertForQuestionAnswering


@pytest.fixture(scope="module")
def cfg(lx):
    return lx.small_config()


@pytest.fixture(scope="module")
def pretrain(cfg):
    torch.manual_seed(0)
    return LxmertForPreTraining(cfg).eval()


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


def test_padding_changes_nothing_for_real_tokens_and_boxes(cfg, lx):
    torch.manual_seed(1)
    model = Lxmert(cfg).eval()
    inputs = lx.make_inputs(cfg, batch=2, tokens=5, boxes=4)
    inputs["attention_mask"][:] = 1
    inputs["visual_attention_mask"] = None
    padded = {k: v.clone() if v is not None else None for k, v in inputs.items()}
    g = torch.Generator().manual_seed(9)
    padded["input_ids"] = torch.cat(
        [inputs["input_ids"], torch.randint(1, cfg.vocab_size, (2, 3), generator=g)], 1
    )
    padded["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.ones(2, 3, dtype=torch.long)], 1)
    padded["attention_mask"] = torch.cat([inputs["attention_mask"], torch.zeros(2, 3, dtype=torch.long)], 1)
    padded["visual_feats"] = torch.cat([inputs["visual_feats"], torch.randn(2, 2, cfg.visual_feat_dim)], 1)
    padded["visual_pos"] = torch.cat([inputs["visual_pos"], torch.rand(2, 2, 4)], 1)
    padded["visual_attention_mask"] = torch.cat([torch.ones(2, 4), torch.zeros(2, 2)], 1)
    with torch.no_grad():
        ref, out = model(**inputs), model(**padded)
    torch.testing.assert_close(out.language_output[:, :5], ref.language_output, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.vision_output[:, :4], ref.vision_output, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.pooled_output, ref.pooled_output, atol=1e-6, rtol=1e-5)
    # and the padding really is in play: without the mask the outputs move
    padded["attention_mask"] = None
    with torch.no_grad():
        unmasked = model(**padded)
    assert not torch.allclose(unmasked.pooled_output, ref.pooled_output, atol=1e-4)


def _reference_losses(cfg, out, labels) -> dict[str, torch.Tensor]:
    """Direct recomputation from full-size logits, slot by slot."""
    scale = 1 / 0.15
    b, n = labels["obj_labels"].shape
    lm_logp = out.lm_logits.log_softmax(-1)
    picked = (labels["lm_labels"] != -100).nonzero().tolist()
    mlm = -sum(lm_logp[i, j, labels["lm_labels"][i, j]] for i, j in picked) / len(picked)
    ref = {"mlm": mlm, "matched": F.cross_entropy(out.matched_logits, labels["matched_labels"])}
    for name in ("obj", "attr"):
        logp = getattr(out, f"{name}_logits").log_softmax(-1)
        total = sum(
            -logp[i, j, labels[f"{name}_labels"][i, j]] * labels[f"{name}_weights"][i, j]
            for i in range(b)
            for j in range(n)
        )
        ref[name] = total / (b * n) * scale
    diff = (out.feat_pred - labels["feat_targets"]).abs()
    smooth = torch.where(diff < 1, 0.5 * diff**2, diff - 0.5).mean(-1)
    ref["feat"] = (smooth * labels["feat_weights"]).sum() / (b * n) * scale
    answered = [i for i in range(b) if labels["answer_labels"][i] != -100]
    qa_logp = out.answer_logits.log_softmax(-1)
    ref["qa"] = -sum(qa_logp[i, labels["answer_labels"][i]] for i in answered) / len(answered)
    return ref


def test_losses_agree_with_direct_recomputation(cfg, pretrain, lx):
    inputs = lx.make_inputs(cfg)
    labels = lx.make_labels(cfg, inputs)
    with torch.no_grad():
        full = pretrain(**inputs)  # no labels: every head everywhere
        out = pretrain(**inputs, **labels)
    expected = _reference_losses(cfg, full, labels)
    assert set(out.losses) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(out.losses[name], value, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(out.loss, sum(expected.values()), atol=1e-5, rtol=1e-5)
    picked = labels["lm_labels"] != -100
    assert out.lm_logits.shape == (int(picked.sum()), cfg.vocab_size)
    torch.testing.assert_close(out.lm_logits, full.lm_logits[picked], atol=1e-5, rtol=1e-5)


def test_left_padding_is_refused(cfg, lx):
    """The pooler reads position 0 and padding has no state, so a left-padded row would pool nothing."""
    inputs = lx.make_inputs(cfg)
    inputs["attention_mask"] = inputs["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="pad on the right"):
        Lxmert(cfg)(**inputs)


def test_labels_at_padding_count_for_nothing(cfg, pretrain, lx):
    """Padding has no state, so MLM labels on padded tokens and object weights on padded boxes are
    ignored: the losses equal those with the padding left unlabelled."""
    inputs = lx.make_inputs(cfg)
    clean = lx.make_labels(cfg, inputs)
    tokens, boxes = lx.real(inputs)
    junk = {k: v.clone() for k, v in clean.items()}
    junk["lm_labels"][~tokens] = 3
    for name in ("obj_weights", "attr_weights", "feat_weights"):
        junk[name][~boxes] = 1.0
    with torch.no_grad():
        expected, got = pretrain(**inputs, **clean), pretrain(**inputs, **junk)
    assert set(got.losses) == set(expected.losses)
    for name, value in expected.losses.items():
        torch.testing.assert_close(got.losses[name], value, atol=1e-6, rtol=1e-6, msg=name)
    assert got.lm_logits.shape == expected.lm_logits.shape


def test_only_given_losses_and_no_nan_when_nothing_is_masked(cfg, pretrain, lx):
    inputs = lx.make_inputs(cfg)
    labels = lx.make_labels(cfg, inputs)
    labels["lm_labels"][:] = -100
    labels["answer_labels"][:] = -100
    labels["feat_weights"][:] = 0
    model = LxmertForPreTraining(cfg).train()
    out = model(**inputs, **labels)
    assert torch.isfinite(out.loss)
    assert out.losses["mlm"].item() == 0 and out.losses["qa"].item() == 0 and out.losses["feat"].item() == 0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

    only_matched = pretrain(**inputs, matched_labels=labels["matched_labels"])
    assert set(only_matched.losses) == {"matched"} and only_matched.obj_logits is None
    nothing = pretrain(**inputs)
    assert nothing.losses == {} and nothing.loss.item() == 0
    with pytest.raises(ValueError, match="obj"):
        pretrain(**inputs, obj_labels=labels["obj_labels"])


def test_gradients_reach_every_parameter(cfg, lx):
    torch.manual_seed(2)
    model = LxmertForPreTraining(cfg).train()
    inputs = lx.make_inputs(cfg)
    out = model(**inputs, **lx.make_labels(cfg, inputs))
    out.loss.backward()
    starved = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert starved == []
    # the rows the release froze through padding_idx=0: position 0 ([CLS]) and token type 0
    emb = model.lxmert.embeddings
    assert emb.position.weight.grad[0].abs().sum() > 0 and emb.token_type.weight.grad[0].abs().sum() > 0


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


def test_cross_attention_maps_only_on_request(cfg, pretrain, lx):
    inputs = lx.make_inputs(cfg)
    with torch.no_grad():
        plain = pretrain.lxmert(**inputs)
        maps = pretrain.lxmert(**inputs, output_attentions=True)
    assert plain.attentions is None
    assert len(maps.attentions) == cfg.x_layers
    att = maps.attentions[0]
    assert att.shape == (3, cfg.num_attention_heads, 7, 5)
    torch.testing.assert_close(att.sum(-1), torch.ones(att.shape[:-1]))
    assert (att[-1, :, :, -2:] == 0).all()  # padded boxes get no attention
    torch.testing.assert_close(maps.pooled_output, plain.pooled_output)


def test_bad_visual_inputs_are_named(cfg, pretrain, lx):
    inputs = lx.make_inputs(cfg)
    inputs["visual_feats"] = inputs["visual_feats"][..., :-1]
    with pytest.raises(ValueError, match="visual_feat_dim"):
        pretrain(**inputs)


def test_bf16_autocast_step_runs(cfg, lx):
    """Mixed precision: the same code path under autocast (CPU here; CUDA in the same way)."""
    torch.manual_seed(5)
    model = LxmertForPreTraining(cfg).train()
    inputs = lx.make_inputs(cfg)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**inputs, **lx.make_labels(cfg, inputs))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow
def test_torch_compile_matches_eager_and_trains(cfg, lx):
    """torch.compile (inductor; CPU here, CUDA the same way) gives the eager outputs and a finite step."""
    torch.manual_seed(7)
    model = LxmertForPreTraining(cfg).eval()
    inputs = lx.make_inputs(cfg)
    labels = lx.make_labels(cfg, inputs)
    compiled = torch.compile(model)
    with torch.no_grad():
        eager, fast = model(**inputs, **labels), compiled(**inputs, **labels)
    torch.testing.assert_close(fast.loss, eager.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.answer_logits, eager.answer_logits, atol=1e-5, rtol=1e-5)
    model.train()
    compiled(**inputs, **labels).loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
