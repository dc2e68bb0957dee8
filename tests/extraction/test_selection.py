"""The three region-selection rules agree with brute-force re-implementations on random score tables; the
batched caffe rule equals the per-image one bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.ops import nms

from extraction import selection
from extraction.config import SELECTION_RULES
from extraction.selection import (
    BATCHED_NMS_ELEMENTS,
    RULES,
    SelectionConfig,
    nms_suppression,
    per_class_max_conf,
    per_class_max_conf_batched,
    select,
    select_caffe,
    select_caffe_batched,
    select_maxnms,
    select_threshold,
)


def iou(a: np.ndarray, b: np.ndarray) -> float:
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(iw, 0.0) * max(ih, 0.0)
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def greedy_nms(boxes: np.ndarray, scores: np.ndarray, thresh: float) -> list[int]:
    kept: list[int] = []
    for i in sorted(range(len(scores)), key=lambda i: -scores[i]):
        if all(iou(boxes[i], boxes[k]) <= thresh for k in kept):
            kept.append(i)
    return kept


def brute_caffe(boxes, probs, cfg):
    fg = probs[:, :-1]
    max_conf = np.zeros(len(boxes))
    for c in range(fg.shape[1]):
        for k in greedy_nms(boxes, fg[:, c], cfg.nms_thresh):
            max_conf[k] = max(max_conf[k], fg[k, c])
    keep = [i for i in range(len(boxes)) if max_conf[i] >= cfg.conf_thresh]
    by_conf = sorted(range(len(boxes)), key=lambda i: -max_conf[i])
    if len(keep) < cfg.min_boxes:
        keep = by_conf[: cfg.min_boxes]
    elif len(keep) > cfg.max_boxes:
        keep = by_conf[: cfg.max_boxes]
    return keep, [int(fg[i].argmax()) for i in keep]


def brute_maxnms(probs, pred_boxes, cfg):
    fg = probs[:, :-1]
    cls = [int(fg[i].argmax()) for i in range(len(fg))]
    boxes = np.stack([pred_boxes[i, c] for i, c in enumerate(cls)])
    scores = np.array([fg[i, c] for i, c in enumerate(cls)])
    for t in cfg.maxnms_thresholds:
        keep = greedy_nms(boxes, scores, t)
        if len(keep) >= cfg.min_boxes:
            break
    keep = keep[: cfg.max_boxes]
    return keep, [cls[i] for i in keep]


def brute_threshold(probs, pred_boxes, cfg):
    fg = probs[:, :-1]

    def survivors(thresh):
        out = []
        for c in range(fg.shape[1]):
            rows = [i for i in range(len(fg)) if fg[i, c] > thresh]
            for j in greedy_nms(pred_boxes[rows, c], fg[rows, c], cfg.nms_thresh):
                out.append((fg[rows[j], c], rows[j], c))
        return sorted(out, key=lambda t: -t[0])

    passing = survivors(cfg.score_thresh)
    if len(passing) >= cfg.min_boxes:
        chosen = passing[: cfg.max_boxes]
    else:
        chosen = survivors(-1.0)[: cfg.min_boxes]
        assert chosen[: len(passing)] == passing
    return [r for _, r, _ in chosen], [c for _, _, c in chosen]


def score_table(seed: int, num: int = 40, classes: int = 25, temperature: float = 3.0):
    rng = np.random.default_rng(seed)
    centres = rng.uniform(0, 200, size=(6, 2))
    xy = centres[rng.integers(0, 6, num)] + rng.normal(0, 15, size=(num, 2))
    wh = rng.uniform(10, 60, size=(num, 2))
    boxes = np.concatenate([xy, xy + wh], axis=1).astype(np.float32)
    logits = rng.normal(0, temperature, size=(num, classes + 1))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    pred = boxes[:, None, :] + rng.normal(0, 8, size=(num, classes, 4)).astype(np.float32)
    pred = np.concatenate([pred[..., :2], np.maximum(pred[..., 2:], pred[..., :2] + 1)], axis=-1)
    return boxes, probs.astype(np.float32), pred.astype(np.float32)


# temperatures from near-uniform (nothing reaches 0.2: min_boxes fill-up) to peaked (clamped to max_boxes)
SETTINGS = [(0.3, 12, 20), (1.0, 5, 10), (1.5, 20, 30), (3.0, 10, 20), (6.0, 3, 8)]
CASES = [(seed, temp, lo, hi) for seed in range(5) for temp, lo, hi in SETTINGS]


@pytest.mark.parametrize(("seed", "temperature", "min_boxes", "max_boxes"), CASES)
def test_caffe_rule_matches_brute_force(seed, temperature, min_boxes, max_boxes):
    boxes, probs, _ = score_table(seed, temperature=temperature)
    cfg = SelectionConfig("caffe", min_boxes, max_boxes)
    got = select_caffe(torch.from_numpy(boxes), torch.from_numpy(probs), cfg)
    keep, classes = brute_caffe(boxes, probs, cfg)
    assert got.index.tolist() == keep
    assert got.classes.tolist() == classes
    np.testing.assert_array_equal(got.boxes.numpy(), boxes[keep])
    np.testing.assert_allclose(got.scores.numpy(), probs[keep, :-1].max(1), rtol=1e-6)


@pytest.mark.parametrize("floor", [0.2, 0.05, 0.0])
def test_max_conf_with_floor_is_exact_above_the_floor(floor):
    boxes, probs, _ = score_table(11, temperature=3.0)
    full = per_class_max_conf(torch.from_numpy(boxes), torch.from_numpy(probs[:, :-1]), 0.3)
    part = per_class_max_conf(torch.from_numpy(boxes), torch.from_numpy(probs[:, :-1]), 0.3, floor)
    known = full >= floor
    assert torch.equal(part[known], full[known])
    assert bool((part[~known] == 0).all())


def per_class_loop_max_conf(
    boxes: torch.Tensor, fg: torch.Tensor, thresh: float, floor: float
) -> torch.Tensor:
    """The per-class loop the batched call replaces: one torchvision NMS per class, over that class's
    pairs in proposal order (a stable sort keeps the lower proposal first among tied scores)."""
    max_conf = torch.zeros(fg.shape[0])
    for c in range(fg.shape[1]):
        idx = torch.nonzero(fg[:, c] >= floor).flatten()
        if idx.numel():
            keep = idx[nms(boxes[idx], fg[idx, c], thresh)]
            max_conf[keep] = torch.maximum(max_conf[keep], fg[keep, c])
    return max_conf


def tied_score_table(seed: int, num: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Boxes with exact duplicates and heavy overlap, and foreground scores on a coarse grid (many ties)."""
    boxes_np, _, _ = score_table(seed, num=num, classes=classes)
    boxes = torch.from_numpy(boxes_np)
    boxes[num // 2 :: 3] = boxes[: len(boxes[num // 2 :: 3])]  # duplicated boxes: IoU exactly 1
    rng = np.random.default_rng(seed)
    fg = torch.from_numpy(rng.integers(0, 8, size=(num, classes)).astype(np.float32) / 20)
    return boxes, fg


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("floor", [0.0, 0.05, 0.2])
@pytest.mark.parametrize(("num", "classes"), [(40, 25), (300, 60)])  # 300 x 60 takes the >4000 path
def test_batched_max_conf_equals_per_class_loop(seed, floor, num, classes):
    boxes, fg = tied_score_table(seed, num, classes)
    got = per_class_max_conf(boxes, fg, 0.3, floor)
    want = per_class_loop_max_conf(boxes, fg, 0.3, floor)
    assert torch.equal(got, want)
    assert bool((want > 0).any())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_max_conf_on_cuda_equals_the_cpu_loop():
    boxes, fg = tied_score_table(7, 300, 1600)
    got = per_class_max_conf(boxes.cuda(), fg.cuda(), 0.3, 0.05).cpu()
    assert torch.equal(got, per_class_loop_max_conf(boxes, fg, 0.3, 0.05))


@pytest.mark.parametrize(("seed", "temperature", "min_boxes", "max_boxes"), CASES)
def test_maxnms_rule_matches_brute_force(seed, temperature, min_boxes, max_boxes):
    _, probs, pred = score_table(seed, temperature=temperature)
    cfg = SelectionConfig("maxnms", min_boxes, max_boxes)
    got = select_maxnms(torch.from_numpy(probs), torch.from_numpy(pred), cfg)
    keep, classes = brute_maxnms(probs, pred, cfg)
    assert got.index.tolist() == keep
    assert got.classes.tolist() == classes
    np.testing.assert_array_equal(got.boxes.numpy(), pred[keep, classes])


@pytest.mark.parametrize(("seed", "temperature", "min_boxes", "max_boxes"), CASES)
def test_threshold_rule_matches_brute_force(seed, temperature, min_boxes, max_boxes):
    _, probs, pred = score_table(seed, temperature=temperature)
    cfg = SelectionConfig("threshold", min_boxes, max_boxes)
    got = select_threshold(torch.from_numpy(probs), torch.from_numpy(pred), cfg)
    keep, classes = brute_threshold(probs, pred, cfg)
    assert got.index.tolist() == keep
    assert got.classes.tolist() == classes
    np.testing.assert_array_equal(got.boxes.numpy(), pred[keep, classes])
    np.testing.assert_allclose(got.scores.numpy(), probs[keep, classes], rtol=1e-6)


def test_rules_return_fewer_than_min_when_the_image_has_fewer():
    boxes, probs, pred = score_table(3, num=5)
    for rule in ("caffe", "maxnms"):
        cfg = SelectionConfig(rule, 36, 36)
        got = (
            select_caffe(torch.from_numpy(boxes), torch.from_numpy(probs), cfg)
            if rule == "caffe"
            else (select_maxnms(torch.from_numpy(probs), torch.from_numpy(pred), cfg))
        )
        assert 0 < got.index.numel() <= 5


def test_rules_accept_no_proposals():
    probs = torch.zeros(0, 26)
    pred = torch.zeros(0, 25, 4)
    for fn in (select_maxnms, select_threshold):
        assert fn(probs, pred, SelectionConfig("maxnms")).index.numel() == 0
    assert select_caffe(torch.zeros(0, 4), probs, SelectionConfig()).index.numel() == 0


def test_rule_table_dispatches_and_says_which_rules_need_boxes():
    boxes, probs, pred = score_table(4)
    b, p, r = torch.from_numpy(boxes), torch.from_numpy(probs), torch.from_numpy(pred)
    assert SELECTION_RULES == tuple(RULES) == ("caffe", "maxnms", "threshold")
    assert {name for name, rule in RULES.items() if not rule.needs_boxes} == {"caffe"}
    direct = {
        "caffe": select_caffe(b, p, SelectionConfig("caffe", 5, 10)),
        "maxnms": select_maxnms(p, r, SelectionConfig("maxnms", 5, 10)),
        "threshold": select_threshold(p, r, SelectionConfig("threshold", 5, 10)),
    }
    for name, want in direct.items():
        got = select(b, p, r if RULES[name].needs_boxes else None, SelectionConfig(name, 5, 10))
        assert torch.equal(got.index, want.index) and torch.equal(got.classes, want.classes), name
    with pytest.raises(ValueError, match="needs the regressed boxes"):
        select(b, p, None, SelectionConfig("maxnms"))
    with pytest.raises(ValueError, match="selection rule must be one of"):
        SelectionConfig("best")


LEVELS = np.array([0.0, 0.005, 0.01, 0.03, 0.05, 0.1, 0.2, 0.25, 0.4], dtype=np.float32)  # floors, thresholds


def caffe_image(rng: np.random.Generator, num: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's proposals and probabilities, drawn to be hard: integer boxes on a small grid (duplicates,
    IoUs exactly at thresholds, some of zero area) or clustered real ones; scores softmaxed or drawn from
    LEVELS (ties, values exactly at the floors and the thresholds)."""
    if rng.random() < 0.5:
        xy = rng.integers(0, 6, size=(num, 2))
        boxes = np.concatenate([xy, xy + rng.integers(0, 4, size=(num, 2))], axis=1).astype(np.float32)
    else:
        boxes, _, _ = score_table(int(rng.integers(1 << 30)), num=num, classes=1)
        boxes[num // 2 :: 4] = boxes[: len(boxes[num // 2 :: 4])]
    if rng.random() < 0.5:
        logits = rng.normal(0, rng.choice([0.3, 1.0, 3.0, 6.0]), size=(num, classes + 1))
        probs = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(np.float32)
    else:
        probs = rng.choice(LEVELS, size=(num, classes + 1))
    return torch.from_numpy(boxes), torch.from_numpy(probs)


def caffe_batch(seed: int, classes: int = 25) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    rng = np.random.default_rng(seed)
    images = [
        caffe_image(rng, int(rng.choice([0, 1, 7, 30, 60])), classes) for _ in range(int(rng.integers(1, 6)))
    ]
    return [b for b, _ in images], [p for _, p in images]


@pytest.mark.parametrize("thresh", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("seed", range(20))
def test_batched_nms_keeps_what_torchvision_keeps(seed, thresh):
    """One class with positive scores: max_conf > 0 marks exactly the boxes torchvision's nms keeps."""
    rng = np.random.default_rng(seed)
    boxes, probs = caffe_image(rng, 50, 1)
    scores = probs[:, 0] + 0.5  # positive, ties kept
    got = per_class_max_conf_batched(
        boxes[None], scores[None, :, None], torch.ones(1, 50, dtype=torch.bool), thresh
    )
    want = torch.zeros(50, dtype=torch.bool)
    want[nms(boxes, scores, thresh)] = True
    assert torch.equal(got[0] > 0, want)


@pytest.mark.parametrize("chunk", [BATCHED_NMS_ELEMENTS, 1000])  # 1000: the classes in several passes
@pytest.mark.parametrize("seed", range(12))
def test_batched_max_conf_equals_per_class_max_conf_at_every_floor(seed, chunk, monkeypatch):
    monkeypatch.setattr(selection, "BATCHED_NMS_ELEMENTS", chunk)
    classes = 60 if seed % 3 == 0 else 25  # 60 x 60 proposals: the >4000 (per-class) path of batched_nms
    proposals, probs = caffe_batch(seed, classes)
    boxes = torch.nn.utils.rnn.pad_sequence(proposals, batch_first=True)
    fg = torch.nn.utils.rnn.pad_sequence([p[:, :-1] for p in probs], batch_first=True)
    valid = torch.nn.utils.rnn.pad_sequence(
        [torch.ones(len(p), dtype=torch.bool) for p in probs], batch_first=True
    )
    if boxes.shape[1] == 0:
        return
    got = per_class_max_conf_batched(boxes, fg, valid, 0.3)
    assert bool((got[~valid] == 0).all())
    for i, (b, p) in enumerate(zip(proposals, probs, strict=True)):
        exact = got[i, : len(b)]
        for floor in (0.0, 0.01, 0.05, 0.2):
            want = per_class_max_conf(b, p[:, :-1], 0.3, floor)
            assert torch.equal(torch.where(exact >= floor, exact, 0.0), want), (i, floor)


CAFFE_CONFIGS = [
    SelectionConfig("caffe", lo, hi, conf_thresh=conf, nms_thresh=nms_thresh)
    for lo, hi in ((0, 3), (5, 10), (12, 20), (36, 36), (1, 100))
    for conf, nms_thresh in ((0.2, 0.3), (0.05, 0.5), (0.0, 0.3), (0.25, 0.7), (0.03, 0.3))
]


@pytest.mark.parametrize("seed", range(8))
def test_batched_caffe_rule_equals_the_per_image_rule(seed):
    proposals, probs = caffe_batch(100 + seed)
    for cfg in CAFFE_CONFIGS:
        got = select_caffe_batched(proposals, probs, cfg)
        for i, (b, p) in enumerate(zip(proposals, probs, strict=True)):
            want = select_caffe(b, p, cfg)
            for field in ("index", "boxes", "classes", "scores"):
                assert torch.equal(getattr(got[i], field), getattr(want, field)), (cfg, i, field)


def test_batched_caffe_rule_accepts_images_without_proposals():
    probs = [torch.zeros(0, 26), torch.zeros(0, 26)]
    got = select_caffe_batched([torch.zeros(0, 4), torch.zeros(0, 4)], probs, SelectionConfig())
    assert [s.index.numel() for s in got] == [0, 0]
    assert select_caffe_batched([], [], SelectionConfig()) == []


def test_suppression_compares_like_the_device_nms():
    """IoU = float32(0.3) is above 0.3 in float64 (torchvision's CPU nms suppresses) but not above the
    float32 threshold its CUDA kernel compares with (tests/extraction/test_cuda_extraction.py checks that)."""
    x = float(torch.tensor(0.3, dtype=torch.float32))
    boxes = torch.tensor([[[0, 0, 1, 1], [0, 0, x, 1]]], dtype=torch.float32)
    assert nms(boxes[0], torch.tensor([0.9, 0.8]), 0.3).tolist() == [0]
    assert nms_suppression(boxes, 0.3)[0, 0, 1]
