"""Pre-training losses against independent computations: MLM CE, masked-region KL (or the hard-label
fallback weighted by confidence) and alignment CE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.vilbert import VilbertForPreTraining


@pytest.fixture(scope="module")
def setup(vb):
    cfg = vb.small_config()
    torch.manual_seed(0)
    model = vb.perturb(VilbertForPreTraining(cfg)).eval()
    inputs = vb.make_inputs(cfg)
    b, n = inputs["visual_feats"].shape[:2]
    g = torch.Generator().manual_seed(7)
    lm = torch.full_like(inputs["input_ids"], -100)
    lm[0, 2], lm[1, 1], lm[2, 5] = 4, 9, 11
    region_mask = torch.zeros(b, n)
    region_mask[0, 1] = region_mask[2, 0] = region_mask[2, 4] = 1  # [2, 4] is padding: ignored
    labels = {
        "lm_labels": lm,
        "matched_labels": torch.tensor([1, 0, 1]),
        "region_mask": region_mask,
        "region_probs": torch.softmax(torch.randn(b, n, cfg.v_target_size, generator=g), -1),
    }
    return cfg, model, inputs, labels


def test_losses_match_independent_computations(setup):
    cfg, model, inputs, labels = setup
    with torch.no_grad():
        out = model(**inputs, **labels)
        ref = model(**inputs)  # no labels: every head everywhere
    lm = labels["lm_labels"]
    expected_mlm = F.cross_entropy(ref.lm_logits.flatten(0, 1), lm.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.losses["mlm"], expected_mlm)
    torch.testing.assert_close(
        out.losses["matched"], F.cross_entropy(ref.matched_logits, labels["matched_labels"])
    )
    picked = [(0, 1), (2, 0)]
    kl = torch.nn.KLDivLoss(reduction="sum")
    expected_region = sum(
        kl(F.log_softmax(ref.region_logits[i, j], -1), labels["region_probs"][i, j]) for i, j in picked
    ) / len(picked)
    torch.testing.assert_close(out.losses["region"], expected_region)
    torch.testing.assert_close(out.loss, expected_mlm + out.losses["matched"] + expected_region)
    assert out.region_logits.shape == (2, cfg.v_target_size)
    assert ref.region_logits.shape == (*inputs["visual_feats"].shape[:2], cfg.v_target_size)


def test_hard_label_fallback_is_confidence_weighted_ce(setup):
    cfg, model, inputs, labels = setup
    b, n = labels["region_mask"].shape
    classes = torch.arange(b * n).view(b, n) % cfg.v_target_size
    conf = torch.linspace(0.2, 1.0, b * n).view(b, n)
    with torch.no_grad():
        out = model(**inputs, region_mask=labels["region_mask"], region_labels=classes, region_weights=conf)
        ref = model(**inputs)
    picked = [(0, 1), (2, 0)]
    expected = sum(
        F.cross_entropy(ref.region_logits[i, j][None], classes[i, j][None]) * conf[i, j] for i, j in picked
    ) / len(picked)
    torch.testing.assert_close(out.losses["region"], expected)
    assert set(out.losses) == {"region"}


def test_nothing_masked_gives_zero_not_nan(setup):
    cfg, model, inputs, labels = setup
    with torch.no_grad():
        out = model(
            **inputs,
            lm_labels=torch.full_like(inputs["input_ids"], -100),
            region_mask=torch.zeros_like(labels["region_mask"]),
            region_probs=labels["region_probs"],
        )
    assert out.losses["mlm"] == 0 and out.losses["region"] == 0


def test_region_mask_needs_targets(setup):
    cfg, model, inputs, labels = setup
    with pytest.raises(ValueError, match="region_probs"):
        model(**inputs, region_mask=labels["region_mask"])


def test_mlm_decoder_is_the_word_table(setup):
    cfg, model, inputs, labels = setup
    words = model.bert.embeddings.word_embeddings.weight
    with torch.no_grad():
        out = model(**inputs)
        h = model.cls.predictions.transform(out.text_output)
    torch.testing.assert_close(out.lm_logits, h @ words.T + model.cls.predictions.bias)
    assert not any("decoder" in k for k in model.state_dict() if k.startswith("cls.predictions"))


def test_training_step_reaches_every_parameter(setup, vb):
    cfg, _, inputs, labels = setup
    model = VilbertForPreTraining(cfg).train()
    model(**inputs, **labels).loss.backward()
    unused = [n for n, p in model.named_parameters() if p.grad is None]
    assert unused == []
