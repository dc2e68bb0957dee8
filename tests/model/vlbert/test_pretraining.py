"""VL-BERT pre-training: MLM with visual clues, masked RoI classification (soft and hard targets)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.vlbert import VlBertForPreTraining


@pytest.fixture
def model(vl):
    torch.manual_seed(0)
    m = VlBertForPreTraining(vl.small_config()).eval()
    vl.wake(m)
    with torch.no_grad():  # a trained, non-zero mask appearance
        m.object_mask_visual_embedding.weight.normal_()
    return m


def _masked(n_rows: int = 3, n: int = 5) -> torch.Tensor:
    masked = torch.zeros(n_rows, n, dtype=torch.bool)
    masked[0, 1] = masked[1, 3] = masked[2, 0] = True
    masked[2, 4] = True  # a padded region of row 2: must count for nothing
    return masked


def test_soft_cross_entropy_to_the_class_distribution(model, vl):
    inputs = vl.make_inputs(model.config)
    targets = torch.softmax(torch.randn(3, 5, 11), -1)
    with torch.no_grad():
        out = model(**inputs, region_mask=_masked(), region_probs=targets)
    real = _masked() & inputs["visual_attention_mask"].bool()
    assert out.region_logits.shape == (3, 11)
    expected = -(targets[real] * out.region_logits.log_softmax(-1)).sum(-1).mean()
    torch.testing.assert_close(out.losses["mvrc"], expected)
    assert set(out.losses) == {"mvrc"}


def test_hard_labels_weighted_by_confidence(model, vl):
    inputs = vl.make_inputs(model.config)
    labels = torch.randint(0, 11, (3, 5))
    weights = torch.rand(3, 5)
    with torch.no_grad():
        out = model(**inputs, region_mask=_masked(), region_labels=labels, region_weights=weights)
    real = _masked() & inputs["visual_attention_mask"].bool()
    per = F.cross_entropy(out.region_logits, labels[real], reduction="none") * weights[real]
    torch.testing.assert_close(out.losses["mvrc"], per.mean())


def test_hard_labels_index_the_classes_as_the_stored_distribution_does(model, vl):
    """The fallback for stores without class_probs must pick the same class a one-hot distribution does
    (the detector's order, background last: a foreground id is its own index)."""
    inputs = vl.make_inputs(model.config)
    labels = torch.randint(0, 10, (3, 5))
    with torch.no_grad():
        hard = model(**inputs, region_mask=_masked(), region_labels=labels, region_weights=torch.ones(3, 5))
        soft = model(**inputs, region_mask=_masked(), region_probs=F.one_hot(labels, 11).float())
    torch.testing.assert_close(hard.losses["mvrc"], soft.losses["mvrc"])


def test_a_masked_region_leaks_nothing_of_its_appearance(model, vl):
    inputs = vl.make_inputs(model.config)
    masked = _masked()
    changed = inputs["visual_feats"].clone()
    changed[masked] = torch.randn(int(masked.sum()), model.config.visual_feat_dim) * 10
    with torch.no_grad():
        a = model(**inputs, region_mask=masked, region_probs=torch.rand(3, 5, 11))
        b = model(
            **{**inputs, "visual_feats": changed}, region_mask=masked, region_probs=torch.rand(3, 5, 11)
        )
        plain = model(**inputs)
    torch.testing.assert_close(a.region_logits, b.region_logits)
    torch.testing.assert_close(a.text_output, b.text_output)
    assert not torch.allclose(a.text_output, plain.text_output)  # masking does change what is seen


def test_masked_lm_ignores_padding_and_counts_masked_words(model, vl):
    inputs = vl.make_inputs(model.config)
    lm = torch.full_like(inputs["input_ids"], -100)
    lm[0, 2], lm[2, 5] = 7, 9
    with torch.no_grad():
        out = model(**inputs, lm_labels=lm)
        lm[1, -1] = 4  # padding in row 1
        again = model(**inputs, lm_labels=lm)
    assert out.lm_logits.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(out.losses["mlm"], F.cross_entropy(out.lm_logits, torch.tensor([7, 9])))
    torch.testing.assert_close(again.loss, out.loss)


def test_zero_initialised_mask_appearance_and_argument_errors(vl):
    cfg = vl.small_config()
    fresh = VlBertForPreTraining(cfg)
    assert not fresh.object_mask_visual_embedding.weight.any()
    inputs = vl.make_inputs(cfg)
    with pytest.raises(ValueError, match="region_probs"):
        fresh(**inputs, region_mask=_masked())
    with pytest.raises(ValueError, match="give both"):
        fresh(**inputs, region_mask=_masked(), region_labels=torch.zeros(3, 5, dtype=torch.long))


def test_gradients_reach_the_mask_embeddings(vl):
    cfg = vl.small_config()
    model = VlBertForPreTraining(cfg)
    vl.wake(model)
    inputs = vl.make_inputs(cfg)
    out = model(**inputs, region_mask=_masked(), region_probs=torch.softmax(torch.randn(3, 5, 11), -1))
    out.loss.backward()
    assert model.object_mask_visual_embedding.weight.grad.abs().sum() > 0
    assert model.object_mask_word_embedding.weight.grad.abs().sum() > 0
