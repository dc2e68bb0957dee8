"""Detector training: the RPN, Fast R-CNN and attribute losses against a re-implementation of detectron2's
formulas written here, RoI sampling, and gradients through the small preset (folded and grad paths agree)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchvision.ops import box_iou

from extraction.box_coder import BoxCoder
from extraction.config import PRESETS, SMALL_PRESET, TRAINING_PRESETS
from extraction.rcnn import VGFasterRCNN, init_random_weights
from extraction.roi_heads import SampledRoIs
from extraction.sampling import Matcher

ROI_WEIGHTS = (10.0, 10.0, 5.0, 5.0)


# ---- the reference formulas, in float64 numpy, one box / one region at a time


def get_deltas(src: np.ndarray, dst: np.ndarray, weights) -> np.ndarray:
    """detectron2 Box2BoxTransform.get_deltas for one pair of (x1, y1, x2, y2) boxes."""
    wx, wy, ww, wh = weights
    sw, sh = src[2] - src[0], src[3] - src[1]
    dw, dh = dst[2] - dst[0], dst[3] - dst[1]
    sx, sy = src[0] + 0.5 * sw, src[1] + 0.5 * sh
    dx, dy = dst[0] + 0.5 * dw, dst[1] + 0.5 * dh
    return np.array(
        [wx * (dx - sx) / sw, wy * (dy - sy) / sh, ww * math.log(dw / sw), wh * math.log(dh / sh)]
    )


def bce_with_logit(x: float, y: float) -> float:
    """-(y log sigmoid(x) + (1 - y) log(1 - sigmoid(x))), written the overflow-free way."""
    return max(x, 0.0) - x * y + math.log1p(math.exp(-abs(x)))


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - math.log(np.exp(z).sum())


def reference_rpn_losses(scores, deltas, anchors, labels, matched, batch_size) -> tuple[float, float]:
    """Objectness BCE over the sampled anchors and L1 on the positives' deltas, both / (images x 256)."""
    cls = loc = 0.0
    for s, d, a, lab, m in zip(scores, deltas, anchors, labels, matched, strict=True):
        s, d, a, m = (t.detach().double().numpy() for t in (s, d, a, m))
        for i, label in enumerate(lab.tolist()):
            if label < 0:
                continue
            cls += bce_with_logit(float(s[i]), float(label))
            if label == 1:
                loc += np.abs(d[i] - get_deltas(a[i], m[i], (1.0, 1.0, 1.0, 1.0))).sum()
    normalizer = batch_size * len(scores)
    return cls / normalizer, loc / normalizer


def reference_roi_losses(predictor, x: torch.Tensor, sampled: list[SampledRoIs], weight: float):
    """Class CE averaged over sampled RoIs; class-specific L1 summed over foreground / sampled RoIs; the
    attribute loss of `attribute_loss`'s docstring (MILVLG): per foreground region the CE averaged over its
    attribute ids, summed over regions, / regions with at least one id, x weight."""
    p = {k: v.detach().double().numpy() for k, v in predictor.state_dict().items()}
    x = x.detach().double().numpy()
    classes = torch.cat([s.classes for s in sampled]).tolist()
    boxes = torch.cat([s.boxes for s in sampled]).double().numpy()
    matched = torch.cat([s.matched_boxes for s in sampled]).double().numpy()
    attrs = [row for s in sampled for row in s.attributes.tolist()]
    num_classes = p["cls_score.weight"].shape[0] - 1
    cls = box = attr = 0.0
    valid = 0
    for i, c in enumerate(classes):
        logits = p["cls_score.weight"] @ x[i] + p["cls_score.bias"]
        cls -= log_softmax(logits)[c]
        if c == num_classes:
            continue
        d = p["bbox_pred.weight"] @ x[i] + p["bbox_pred.bias"]
        box += np.abs(d[4 * c : 4 * c + 4] - get_deltas(boxes[i], matched[i], ROI_WEIGHTS)).sum()
        ids = [a for a in attrs[i] if a >= 0]
        if not ids:
            continue
        joined = np.concatenate([x[i], p["cls_embedding.weight"][c]])
        hidden = np.maximum(p["fc_attr.weight"] @ joined + p["fc_attr.bias"], 0.0)
        attr_logp = log_softmax(p["attr_score.weight"] @ hidden + p["attr_score.bias"])
        attr += -sum(attr_logp[a] for a in ids) / len(ids)
        valid += 1
    n = len(classes)
    return cls / n, box / n, (attr * weight / valid if valid else 0.0)


# ---- fixtures


def random_boxes(gen: torch.Generator, n: int, size: float = 128.0, min_side: float = 8.0) -> torch.Tensor:
    xy = torch.rand(n, 2, generator=gen) * (size - 3 * min_side)
    wh = torch.rand(n, 2, generator=gen) * (size - xy).clamp(min=2 * min_side) * 0.7 + min_side
    return torch.cat([xy, xy + wh], dim=1)


@pytest.fixture(scope="module")
def model() -> VGFasterRCNN:
    torch.set_num_threads(2)
    m = VGFasterRCNN(PRESETS[SMALL_PRESET])
    init_random_weights(m, seed=11)
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():  # larger predictor weights than the init, so every loss term is far from 0
        for p in m.roi_heads.box_predictor.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return m


# ---- RPN


def rpn_batch(seed: int):
    """Two images of fixed anchor labels; the second has no ground truth (matched boxes all zero)."""
    gen = torch.Generator().manual_seed(seed)
    scores, deltas, anchors, labels, matched = [], [], [], [], []
    for n, has_gt in ((300, True), (180, False)):
        scores.append((torch.randn(n, generator=gen) * 3).requires_grad_())
        deltas.append((torch.randn(n, 4, generator=gen) * 0.5).requires_grad_())
        anchors.append(random_boxes(gen, n))
        if has_gt:
            labels.append(torch.randint(-1, 2, (n,), generator=gen))
            matched.append(random_boxes(gen, n))
        else:
            labels.append(torch.randint(-1, 1, (n,), generator=gen))
            matched.append(torch.zeros(n, 4))
    return scores, deltas, anchors, labels, matched


@pytest.mark.parametrize("seed", [0, 1])
def test_rpn_losses_equal_detectron2_formulas(model, seed):
    batch = rpn_batch(seed)
    losses = model.proposal_generator.losses(*batch, 256)
    ref_cls, ref_loc = reference_rpn_losses(*batch, 256)
    assert set(losses) == {"loss_rpn_cls", "loss_rpn_loc"}
    assert float(losses["loss_rpn_cls"].detach()) == pytest.approx(ref_cls, abs=1e-5, rel=1e-5)
    assert float(losses["loss_rpn_loc"].detach()) == pytest.approx(ref_loc, abs=1e-5, rel=1e-5)
    assert ref_loc > 0.1 and ref_cls > 0.1
    # the image without ground truth gives finite gradients (its unused targets are not finite)
    sum(losses.values()).backward()
    scores, deltas = batch[0], batch[1]
    assert all(torch.isfinite(t.grad).all() for t in scores + deltas)
    assert torch.count_nonzero(deltas[1].grad) == 0  # no positives there
    assert torch.equal(scores[0].grad[batch[3][0] < 0], torch.zeros(int((batch[3][0] < 0).sum())))


def test_label_anchors_samples_matcher_labels_and_matches_the_best_box(model):
    rpn = model.proposal_generator
    anchors = rpn.anchor_generator(6, 8)
    gt = torch.tensor([[10.0, 12.0, 60.0, 70.0], [50.0, 20.0, 120.0, 90.0], [0.0, 0.0, 20.0, 16.0]])
    matcher = Matcher([0.3, 0.7], [0, -1, 1], allow_low_quality_matches=True)
    _, full = matcher(box_iou(gt, anchors))
    labels, matched = rpn.label_anchors(anchors, gt, matcher, 64, 0.5, torch.Generator().manual_seed(0))
    assert labels.shape == (anchors.shape[0],) and matched.shape == anchors.shape
    pos, neg = labels == 1, labels == 0
    assert (full[pos] == 1).all() and (full[neg] == 0).all()
    assert int(pos.sum()) == min(32, int((full == 1).sum())) > 0
    assert int(pos.sum() + neg.sum()) == 64
    iou = box_iou(gt, anchors)
    assert torch.equal(iou[:, pos].max(dim=0).values, box_iou(matched[pos], anchors[pos]).diagonal())
    # no ground truth: only negatives, zero matched boxes
    labels, matched = rpn.label_anchors(anchors, torch.zeros(0, 4), matcher, 64, 0.5)
    assert int((labels == 0).sum()) == 64 and int((labels == 1).sum()) == 0
    assert torch.count_nonzero(matched) == 0


def test_head_outputs_are_flattened_y_x_anchor_like_the_anchors(model):
    rpn = model.proposal_generator
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(1, model.backbone.out_channels, 3, 5, generator=gen)
    with torch.no_grad():
        scores, deltas = rpn.head_outputs(features)
        logits, raw = rpn.rpn_head(features)
    na = rpn.anchor_generator.num_anchors
    assert scores.shape == (3 * 5 * na,) and deltas.shape == (3 * 5 * na, 4)
    assert rpn.anchor_generator(3, 5).shape == deltas.shape
    for y, x, a in ((0, 0, 0), (1, 3, 7), (2, 4, na - 1)):
        i = (y * 5 + x) * na + a
        assert float(scores[i]) == float(logits[0, a, y, x])
        assert torch.equal(deltas[i], raw[0, 4 * a : 4 * a + 4, y, x])


# ---- RoI head


def roi_batch(num_classes: int, num_attributes: int, seed: int):
    """Two images' hand-made samples: a few foreground RoIs per class, background RoIs whose matched boxes
    are zeros (any use of them would make the loss infinite), regions with 0..3 attribute ids."""
    gen = torch.Generator().manual_seed(seed)
    bg = num_classes
    images = []
    for n, classes, width, hw in (
        (9, [0, 1, 2, bg, 1, bg, 0, bg, 2], 3, (8, 8)),
        (6, [bg, 2, bg, 0, bg, bg], 1, (6, 9)),
    ):
        boxes = random_boxes(gen, n, size=16.0 * min(hw))
        matched = boxes + torch.randn(n, 4, generator=gen) * 1.5
        classes = torch.tensor(classes)
        matched[classes == bg] = 0.0
        attrs = torch.randint(-1, num_attributes, (n, width), generator=gen)
        attrs[0] = -1  # a foreground region without attributes
        features = torch.randn(1, 128, *hw, generator=gen)
        images.append((features, SampledRoIs(boxes, classes, matched, attrs)))
    return [f for f, _ in images], [s for _, s in images]


@pytest.mark.parametrize(("seed", "weight"), [(0, 0.5), (1, 0.2)])
def test_roi_losses_equal_detectron2_and_milvlg_formulas(model, seed, weight):
    heads = model.roi_heads
    features, sampled = roi_batch(heads.num_classes, 4, seed)
    losses = heads.losses(features, sampled, BoxCoder(ROI_WEIGHTS), weight)
    assert set(losses) == {"loss_cls", "loss_box_reg", "loss_attr"}
    with torch.no_grad():
        x = heads.pooled_features(features, [s.boxes for s in sampled])
    ref = reference_roi_losses(heads.box_predictor, x, sampled, weight)
    for name, value in zip(("loss_cls", "loss_box_reg", "loss_attr"), ref, strict=True):
        assert value > 0.01, name
        assert float(losses[name].detach()) == pytest.approx(value, abs=1e-5, rel=1e-5), name
    sum(losses.values()).backward()
    grads = [p.grad for p in heads.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    heads.zero_grad(set_to_none=True)


def test_roi_losses_without_foreground_or_attributes_are_zero_not_nan(model):
    heads = model.roi_heads
    features, sampled = roi_batch(heads.num_classes, 4, 2)
    bg = heads.num_classes
    only_bg = [
        SampledRoIs(s.boxes, torch.full_like(s.classes, bg), s.matched_boxes * 0, s.attributes)
        for s in sampled
    ]
    losses = heads.losses(features, only_bg, BoxCoder(ROI_WEIGHTS), 0.5)
    assert losses["loss_box_reg"].item() == 0.0 and losses["loss_attr"].item() == 0.0
    assert losses["loss_cls"].item() > 0
    no_attrs = [
        SampledRoIs(s.boxes, s.classes, s.matched_boxes, torch.full_like(s.attributes, -1)) for s in sampled
    ]
    losses = heads.losses(features, no_attrs, BoxCoder(ROI_WEIGHTS), 0.5)
    assert losses["loss_attr"].item() == 0.0 and losses["loss_box_reg"].item() > 0
    sum(losses.values()).backward()
    assert all(torch.isfinite(p.grad).all() for p in heads.parameters() if p.grad is not None)
    heads.zero_grad(set_to_none=True)


def test_box_coder_encode_decode_round_trip():
    gen = torch.Generator().manual_seed(4)
    boxes, targets = random_boxes(gen, 50, 600.0), random_boxes(gen, 50, 600.0)
    for weights in (ROI_WEIGHTS, (1.0, 1.0, 1.0, 1.0)):
        coder = BoxCoder(weights)
        deltas = coder.encode(boxes, targets)
        expected = np.stack(
            [
                get_deltas(b, t, weights)
                for b, t in zip(boxes.double().numpy(), targets.double().numpy(), strict=True)
            ]
        )
        np.testing.assert_allclose(deltas.numpy(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(coder.decode(deltas, boxes), targets, rtol=0, atol=1e-3)
        assert torch.count_nonzero(coder.encode(boxes, boxes)) == 0
        # class-specific layout: each class's 4 deltas decode against the same reference box
        stacked = torch.cat([deltas, coder.encode(boxes, boxes)], dim=1)
        torch.testing.assert_close(
            coder.decode(stacked, boxes), torch.cat([targets, boxes], dim=1), rtol=0, atol=1e-3
        )


# ---- RoI sampling


def gt_set(n_classes: int = 3):
    boxes = torch.tensor([[10.0, 10.0, 50.0, 60.0], [60.0, 20.0, 120.0, 100.0], [5.0, 80.0, 40.0, 125.0]])
    classes = torch.tensor([2, 0, 1])
    attrs = torch.tensor([[1, 3], [-1, -1], [0, -1]])
    return boxes, classes, attrs


def sample(model, proposals, gt, batch_size=128, fraction=0.25, seed=0):
    boxes, classes, attrs = gt
    return model.roi_heads.sample_proposals(
        proposals,
        boxes,
        classes,
        attrs,
        Matcher([0.5], [0, 1]),
        batch_size,
        fraction,
        torch.Generator().manual_seed(seed),
    )


def rows(t: torch.Tensor) -> list[tuple]:
    return sorted(tuple(r) for r in t.tolist())


def test_with_no_proposals_the_ground_truth_is_sampled_as_foreground(model):
    gt = gt_set()
    s = sample(model, torch.zeros(0, 4), gt)
    assert rows(s.boxes) == rows(gt[0])
    assert torch.equal(s.matched_boxes, s.boxes)
    for box, cls, attr in zip(s.boxes, s.classes, s.attributes, strict=True):
        k = int((gt[0] == box).all(dim=1).nonzero())
        assert int(cls) == int(gt[1][k])
        assert attr.tolist() == gt[2][k].tolist()


def test_every_ground_truth_box_is_a_candidate_and_labels_follow_iou(model):
    gen = torch.Generator().manual_seed(5)
    gt = gt_set()
    bg = model.roi_heads.num_classes
    proposals = torch.cat([random_boxes(gen, 60), gt[0] + torch.randn(3, 4, generator=gen) * 2])
    # room for every candidate: all positives and negatives are sampled
    s = sample(model, proposals, gt, batch_size=1000, fraction=1.0)
    candidates = torch.cat([proposals, gt[0]])
    iou = box_iou(gt[0], candidates)
    best, arg = iou.max(dim=0)
    assert rows(s.boxes) == rows(candidates)
    for box, cls, matched, attr in zip(s.boxes, s.classes, s.matched_boxes, s.attributes, strict=True):
        j = int((candidates == box).all(dim=1).nonzero()[0])
        if best[j] >= 0.5:
            assert int(cls) == int(gt[1][arg[j]]) and torch.equal(matched, gt[0][arg[j]])
            assert attr.tolist() == gt[2][arg[j]].tolist()
        else:
            assert int(cls) == bg
    for box, cls in zip(gt[0], gt[1], strict=True):
        hits = (s.boxes == box).all(dim=1)
        assert int(hits.sum()) >= 1 and (s.classes[hits] == cls).all()


def test_positive_fraction_and_background_label(model):
    gen = torch.Generator().manual_seed(6)
    gt = gt_set()
    bg = model.roi_heads.num_classes
    near = gt[0].repeat(30, 1) + torch.randn(90, 4, generator=gen) * 1.5  # ~90 foreground candidates
    far = random_boxes(gen, 400) * 0.2 + 100  # small boxes in a corner: background
    s = sample(model, torch.cat([near, far]), gt, batch_size=128, fraction=0.25)
    fg = s.classes < bg
    assert s.boxes.shape == (128, 4) and int(fg.sum()) == 32
    assert int((s.classes == bg).sum()) == 96
    assert set(s.classes[fg].tolist()) <= {0, 1, 2}
    again = sample(model, torch.cat([near, far]), gt, batch_size=128, fraction=0.25)
    assert torch.equal(again.boxes, s.boxes)


def test_no_ground_truth_samples_only_background(model):
    gen = torch.Generator().manual_seed(7)
    empty = (torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int64))
    s = sample(model, random_boxes(gen, 50), empty, batch_size=32)
    assert s.boxes.shape == (32, 4)
    assert (s.classes == model.roi_heads.num_classes).all()
    assert torch.count_nonzero(s.matched_boxes) == 0 and (s.attributes == -1).all()


# ---- gradients through the whole small detector


def test_training_step_gradients_and_folded_path_after_a_step(make_image):
    torch.set_num_threads(2)
    cfg = PRESETS[SMALL_PRESET]
    model = VGFasterRCNN(cfg)
    init_random_weights(model, seed=21)
    model.backbone.freeze(2)
    model.train()
    bgr = make_image(3, 96, 128).astype(np.float32)
    image = torch.from_numpy(bgr - np.array(cfg.pixel_mean, dtype=np.float32)).permute(2, 0, 1).contiguous()
    target = {
        "boxes": torch.tensor([[8.0, 10.0, 60.0, 70.0], [50.0, 30.0, 120.0, 90.0]]),
        "classes": torch.tensor([1, 2]),
        "attributes": torch.tensor([[0, 3], [2, -1]]),
        "seed": 5,
    }
    losses = model([image], targets=[target], train_cfg=TRAINING_PRESETS[SMALL_PRESET])
    assert set(losses) == {"loss_rpn_cls", "loss_rpn_loc", "loss_cls", "loss_box_reg", "loss_attr"}
    assert all(torch.isfinite(v) and v.item() > 0 for v in losses.values()), losses
    sum(losses.values()).backward()

    frozen = ("backbone.stem.", "backbone.res2.")
    for name, p in model.named_parameters():
        if name.startswith(frozen):
            assert not p.requires_grad and p.grad is None, name
        else:
            assert p.requires_grad, name
            assert p.grad is not None, name
            assert torch.isfinite(p.grad).all() and torch.count_nonzero(p.grad) > 0, name
    # the class embedding learns only the rows of the classes seen
    emb = model.roi_heads.box_predictor.cls_embedding.weight.grad
    assert torch.count_nonzero(emb[0]) == 0 and torch.count_nonzero(emb[1]) > 0

    def outputs(grad: bool):
        # the network's outputs on fixed boxes: selected proposals could flip on near-ties, since the
        # folded and the autograd arithmetic round differently
        with torch.set_grad_enabled(grad):
            res4 = model.backbone(image[None])
            given = model.roi_heads(res4, target["boxes"])
            logits, deltas = model.proposal_generator.head_outputs(res4)
        found = {f"given_{k}": v.detach() for k, v in vars(given).items()}
        return {"res4": res4.detach(), "rpn_logits": logits.detach(), "rpn_deltas": deltas.detach(), **found}

    model.eval()
    before = outputs(False)
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5).step()
    folded, exact = outputs(False), outputs(True)
    for key in folded:
        torch.testing.assert_close(folded[key], exact[key], rtol=1e-5, atol=1e-5, msg=key)
    # the step changed the network, so a stale folded copy would have shown
    assert not torch.allclose(before["res4"], folded["res4"], atol=1e-3)
    assert not torch.allclose(before["given_features"], folded["given_features"], atol=1e-3)
