"""Pre-training losses against independent computations: MLM CE, masked-region KL (or the hard-label
fallback weighted by confidence) and alignment CE."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.vilbert import VilbertForPreTraining
from model.vilbert.embeddings import pretraining_image_feats


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


def _release_mean(inputs, labels):
    return pretraining_image_feats(
        inputs["visual_feats"], inputs["visual_pos"], inputs["visual_attention_mask"], labels["region_mask"]
    )


def test_losses_match_independent_computations(setup):
    cfg, model, inputs, labels = setup
    with torch.no_grad():
        out = model(**inputs, **labels)
        # no labels: every head everywhere, with the global token the labelled pass computed
        image_feats = pretraining_image_feats(
            inputs["visual_feats"],
            inputs["visual_pos"],
            inputs["visual_attention_mask"],
            labels["region_mask"],
        )
        ref = model(**inputs, image_feats=image_feats)
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
        ref = model(**inputs, image_feats=_release_mean(inputs, labels))
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


def _release_global_feature(feats, boxes_px, num_boxes, masked, threshold=0.4):
    """vilbert-multi-task's loader, restated: pixel IoU with +1 widths; every region overlapping a masked
    one by more than the threshold leaves the count; the sum runs over the features as fed."""
    n = num_boxes
    near = [False] * len(feats)
    for i in range(n):
        if not masked[i]:
            continue
        for j in range(n):
            ax1, ay1, ax2, ay2 = boxes_px[i]
            bx1, by1, bx2, by2 = boxes_px[j]
            iw = max(0.0, min(ax2, bx2) - max(ax1, bx1) + 1)
            ih = max(0.0, min(ay2, by2) - max(ay1, by1) + 1)
            union = (ax2 - ax1 + 1) * (ay2 - ay1 + 1) + (bx2 - bx1 + 1) * (by2 - by1 + 1) - iw * ih
            near[j] = near[j] or iw * ih / union > threshold
    count = max(1, sum(1 for j in range(n) if not near[j]))
    return [sum(feats[j][d] for j in range(n)) / count for d in range(len(feats[0]))]


def test_pretraining_global_token_averages_over_regions_clear_of_masked_ones(vb):
    """A 1000 x 800 image: region 0 is masked (zeroed, as the loader feeds it), region 1 overlaps it
    (IoU ~0.8, leaves the count), region 2 a little (IoU ~0.1, stays), 3 is elsewhere, 4 is padding."""
    w, h = 1000.0, 800.0
    boxes_px = [
        [100, 100, 399, 399],
        [120, 110, 409, 399],
        [350, 100, 649, 399],
        [700, 500, 899, 699],
        [0, 0, 0, 0],
    ]
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 5, 6, generator=g)
    feats[0, 0] = 0.0  # a masked region, zeroed
    feats[0, 4] = 7.0  # padding: must count for nothing
    boxes = torch.tensor([boxes_px]) / torch.tensor([w, h, w, h])
    real = torch.tensor([[1, 1, 1, 1, 0]])
    region_mask = torch.tensor([[1, 0, 0, 0, 0]])
    got = pretraining_image_feats(feats, boxes, real, region_mask)
    expected = _release_global_feature(feats[0].tolist(), boxes_px, 4, [True, False, False, False])
    torch.testing.assert_close(got[0], torch.tensor(expected), rtol=1e-5, atol=1e-6)
    # sum of regions 1..3 over the 2 regions clear of region 0 (2 and 3), not the plain mean over 4
    torch.testing.assert_close(got[0], feats[0, 1:4].sum(0) / 2)
    # the pre-training model feeds it; without masked regions it is the plain mean again
    cfg = vb.small_config(visual_feat_dim=6)
    torch.manual_seed(0)
    model = VilbertForPreTraining(cfg).eval()
    inputs = {
        "input_ids": torch.tensor([[2, 5, 6, 3]]),
        "visual_feats": feats,
        "visual_pos": boxes,
        "visual_attention_mask": real,
    }
    probs = torch.softmax(torch.randn(1, 5, cfg.v_target_size, generator=g), -1)
    with torch.no_grad():
        labelled = model(**inputs, region_mask=region_mask, region_probs=probs)
        given = model(**inputs, image_feats=got)
        plain = model(**inputs)
    torch.testing.assert_close(labelled.vision_output, given.vision_output)
    assert not torch.allclose(labelled.vision_output[:, 0], plain.vision_output[:, 0])
    mean = pretraining_image_feats(feats, boxes, real, torch.zeros_like(region_mask))
    torch.testing.assert_close(mean[0], feats[0, :4].mean(0))
