"""The caffe stem and feature sizes, and the padding-masked backbone and RPN on a batch."""

from __future__ import annotations

import math

import torch

from extraction.preprocess import batch_images, resize_image


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
