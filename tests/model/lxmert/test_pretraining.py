"""LxmertForPreTraining: the five losses, labels at padding, gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import LxmertForPreTraining


@pytest.fixture(scope="module")
def cfg(lx):
    return lx.small_config()


@pytest.fixture(scope="module")
def pretrain(cfg):
    torch.manual_seed(0)
    return LxmertForPreTraining(cfg).eval()


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
