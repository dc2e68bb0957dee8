"""Anchors, box decoding and the padding-masked backbone and RPN, checked against detectron2's formulas."""

from __future__ import annotations

import math

import torch

from extraction.anchors import AnchorGenerator
from extraction.box_coder import SCALE_CLAMP, BoxCoder, clip_boxes, nonempty
from extraction.preprocess import batch_images, resize_image


def test_cell_anchors_are_centred_and_size_major():
    gen = AnchorGenerator((64.0, 128.0, 256.0, 512.0), (0.5, 1.0, 2.0))
    cells = gen.cell_anchors
    assert cells.shape == (12, 4)
    for i, (size, ratio) in enumerate((s, r) for s in (64, 128, 256, 512) for r in (0.5, 1.0, 2.0)):
        w = math.sqrt(size * size / ratio)
        h = ratio * w
        torch.testing.assert_close(cells[i], torch.tensor([-w / 2, -h / 2, w / 2, h / 2]))


def test_grid_anchors_order_is_y_x_anchor():
    gen = AnchorGenerator((64.0, 128.0), (0.5, 1.0, 2.0))
    anchors = gen(2, 3)
    assert anchors.shape == (2 * 3 * 6, 4)
    for y in range(2):
        for x in range(3):
            for a in range(6):
                shift = torch.tensor([16.0 * x, 16.0 * y] * 2)
                torch.testing.assert_close(anchors[(y * 3 + x) * 6 + a], gen.cell_anchors[a] + shift)


def test_decode_matches_the_formula_and_clamps_scale():
    box = torch.tensor([[10.0, 20.0, 50.0, 100.0]])  # w 40, h 80, centre (30, 60)
    deltas = torch.tensor([[1.0, -2.0, 0.5, 100.0]])
    out = BoxCoder((10.0, 10.0, 5.0, 5.0)).decode(deltas, box)[0]
    cx, cy = 30 + 0.1 * 40, 60 - 0.2 * 80
    w, h = math.exp(0.1) * 40, math.exp(SCALE_CLAMP) * 80  # dh = 20 is clamped to log(1000/16)
    torch.testing.assert_close(out, torch.tensor([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2]))


def test_class_specific_decode_keeps_the_layout():
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [5.0, 5.0, 25.0, 15.0]])
    deltas = torch.randn(2, 3 * 4, generator=torch.Generator().manual_seed(0))
    coder = BoxCoder((10.0, 10.0, 5.0, 5.0))
    out = coder.decode(deltas, boxes)
    for c in range(3):
        torch.testing.assert_close(
            out[:, 4 * c : 4 * c + 4], coder.decode(deltas[:, 4 * c : 4 * c + 4], boxes)
        )


def test_clip_and_nonempty():
    boxes = torch.tensor([[-5.0, 2.0, 30.0, 50.0], [12.0, 3.0, 40.0, 3.0]])
    clipped = clip_boxes(boxes, 40, 20)
    assert clipped.tolist() == [[0.0, 2.0, 20.0, 40.0], [12.0, 3.0, 20.0, 3.0]]
    assert nonempty(clipped).tolist() == [True, False]


def res4_size(n: int) -> int:
    """conv 7x7/2 p3 -> caffe pool k3 s2 p0 ceil -> two stride-2 1x1 convs."""
    n = (n - 1) // 2 + 1
    n = math.ceil((n - 3) / 2) + 1
    for _ in range(2):
        n = (n - 1) // 2 + 1
    return n


def test_caffe_stem_pool_and_feature_sizes(small_detector):
    backbone = small_detector.model.backbone
    with torch.inference_mode():
        stem = backbone.stem(torch.zeros(1, 3, 600, 800))
        assert stem.shape[-2:] == (150, 200)  # 300x400 -> ceil((300-3)/2)+1, padding 0
        assert tuple(backbone(torch.zeros(1, 3, 65, 97)).shape[-2:]) == (res4_size(65), res4_size(97))
    sizes = [(600, 800), (600, 1000), (333, 1000), (65, 97)]
    assert backbone.output_sizes(sizes) == [(res4_size(h), res4_size(w)) for h, w in sizes]
    assert backbone.output_sizes(sizes)[:3] == [(38, 50), (38, 63), (21, 63)]


def test_padded_batch_features_equal_single_image_features(small_detector, make_image):
    """The masking keeps padding out of every image's features and proposals."""
    det = small_detector
    images = [
        resize_image(make_image(i, h, w), 64, 96) for i, (h, w) in enumerate([(70, 50), (50, 90), (64, 64)])
    ]
    mean, std = det.config.pixel_mean, det.config.pixel_std
    with torch.inference_mode():
        batch, sizes = batch_images(images, mean, std, torch.device("cpu"))
        feats = det.model.backbone(batch, sizes)
        fsizes = det.model.backbone.output_sizes(sizes)
        props = det.model.proposal_generator(feats, fsizes, sizes)
        for i, im in enumerate(images):
            single, size = batch_images([im], mean, std, torch.device("cpu"))
            alone = det.model.backbone(single, size)
            h, w = fsizes[i]
            assert alone.shape[-2:] == (h, w)
            torch.testing.assert_close(feats[i, :, :h, :w], alone[0], rtol=1e-4, atol=1e-4)
            assert float(feats[i, :, h:, :].abs().sum() + feats[i, :, :, w:].abs().sum()) == 0
            boxes, logits = det.model.proposal_generator(alone, fsizes[i : i + 1], size)[0]
            torch.testing.assert_close(props[i][0], boxes, rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(props[i][1], logits, rtol=1e-4, atol=1e-4)
