"""The network: detectron2's R-101-C4 VG state-dict layout (plus the attribute head), every preset built
and run once, widths taken from the config, and `forward` equal to its parts run one after another."""

from __future__ import annotations

import ast
import dataclasses
import warnings

import pytest
import torch

from extraction import Detector
from extraction.config import PRESETS, DetectorConfig
from extraction.preprocess import batch_images, resize_image
from extraction.rcnn import VGFasterRCNN, init_random_weights

TINY = {"min_size": 64, "max_size": 96, "post_nms_topk": 4}
VG_R101 = DetectorConfig().architecture()


def _norm(prefix: str, ch: int) -> list[tuple[str, tuple]]:
    return [(f"{prefix}.norm.{p}", (ch,)) for p in ("weight", "bias", "running_mean", "running_var")]


def _conv(prefix: str, out_ch: int, in_ch: int, k: int) -> list[tuple[str, tuple]]:
    return [(f"{prefix}.weight", (out_ch, in_ch, k, k)), *_norm(prefix, out_ch)]


def expected_keys() -> list[tuple[str, tuple]]:
    """Generated from the stage layout: (name, shape) in module order."""
    keys = _conv("backbone.stem.conv1", 64, 3, 7)
    stages = [
        ("backbone.res2", 3, 64, 64, 256),
        ("backbone.res3", 4, 256, 128, 512),
        ("backbone.res4", 23, 512, 256, 1024),
        ("roi_heads.res5", 3, 1024, 512, 2048),
    ]
    for name, blocks, in_ch, mid, out in stages:
        for b in range(blocks):
            p = f"{name}.{b}"
            if b == 0:
                keys += _conv(f"{p}.shortcut", out, in_ch, 1)
            keys += _conv(f"{p}.conv1", mid, in_ch if b == 0 else out, 1)
            keys += _conv(f"{p}.conv2", mid, mid, 3)
            keys += _conv(f"{p}.conv3", out, mid, 1)
        if name == "backbone.res4":
            rpn = "proposal_generator.rpn_head"
            keys += [
                (f"{rpn}.conv.weight", (512, 1024, 3, 3)),
                (f"{rpn}.conv.bias", (512,)),
                (f"{rpn}.objectness_logits.weight", (12, 512, 1, 1)),
                (f"{rpn}.objectness_logits.bias", (12,)),
                (f"{rpn}.anchor_deltas.weight", (48, 512, 1, 1)),
                (f"{rpn}.anchor_deltas.bias", (48,)),
            ]
    bp = "roi_heads.box_predictor"
    keys += [
        (f"{bp}.cls_score.weight", (1601, 2048)),
        (f"{bp}.cls_score.bias", (1601,)),
        (f"{bp}.bbox_pred.weight", (6400, 2048)),
        (f"{bp}.bbox_pred.bias", (6400,)),
        (f"{bp}.cls_embedding.weight", (1601, 256)),
        (f"{bp}.fc_attr.weight", (512, 2304)),
        (f"{bp}.fc_attr.bias", (512,)),
        (f"{bp}.attr_score.weight", (401, 512)),
        (f"{bp}.attr_score.bias", (401,)),
    ]
    return keys


def model_keys(config: DetectorConfig | None = None) -> list[tuple[str, tuple]]:
    with torch.device("meta"):
        model = VGFasterRCNN(config or DetectorConfig())
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def reference_keys(shared_reference) -> list[tuple[str, tuple]]:
    ref = []
    for line in (shared_reference / "detectron2_r101_c4_vg_keys.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, shape = line.split(" ", 1)
            ref.append((name, tuple(ast.literal_eval(shape))))
    return ref


def test_state_dict_matches_stage_layout():
    ours, expected = model_keys(), expected_keys()
    assert len(expected) == 535
    assert sorted(set(ours) - set(expected)) == [] and sorted(set(expected) - set(ours)) == []
    assert ours == expected


def test_state_dict_matches_shared_reference(shared_reference):
    assert dict(model_keys()) == dict(reference_keys(shared_reference))


def test_anchor_buffer_is_not_saved():
    names = {k for k, _ in model_keys()}
    assert not any("anchor_generator" in n for n in names)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_builds_and_runs_one_tiny_image(preset, make_image):
    config = dataclasses.replace(PRESETS[preset], **TINY)
    model = VGFasterRCNN(config)
    init_random_weights(model)
    model.eval()
    assert model.feature_dim == 8 * config.res2_channels
    assert [k for k, _ in model_keys(config)] == list(model.state_dict())
    batch, sizes = batch_images(
        [resize_image(make_image(0, 48, 64), 64, 96)],
        config.pixel_mean,
        config.pixel_std,
        torch.device("cpu"),
    )
    with torch.inference_mode():
        (out,) = model(batch, sizes)
    r = out.proposals.shape[0]
    assert 1 <= r <= TINY["post_nms_topk"]
    assert out.features.shape == (r, model.feature_dim) and torch.isfinite(out.features).all()
    assert out.cls_logits.shape == (r, config.num_classes + 1)
    assert out.deltas.shape == (r, 4 * config.num_classes)
    assert out.attr_logits.shape == (r, config.num_attributes + 1)


@pytest.mark.parametrize("preset", sorted(p for p, c in PRESETS.items() if c.architecture() == VG_R101))
def test_vg_presets_have_the_detectron2_state_dict(preset, shared_reference):
    assert model_keys(PRESETS[preset]) == reference_keys(shared_reference)


def test_feature_dim_is_read_from_the_network(make_image):
    """A narrower ResNet (not a preset): 512-d features, and the detector's records say so."""
    narrow = {"res2_channels": 64, "bottleneck_channels": 16, "blocks_per_stage": [1, 1, 1], "res5_blocks": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        det = Detector.build(num_classes=10, num_attributes=5, min_boxes=1, max_boxes=3, **narrow, **TINY)
    assert det.feature_dim == 512 and det.provenance()["feature_dim"] == 512
    rec = det.detect([make_image(1, 50, 70)])[0]
    rec.validate(feature_dim=512, max_boxes=3)
    assert rec.features.shape[1] == 512 and (rec.objects_id < 10).all() and (rec.attrs_id < 5).all()


def test_forward_equals_its_parts_run_in_turn(small_detector, make_image):
    """The network's own forward is the backbone -> RPN -> RoI head chain, bit for bit."""
    model, cfg = small_detector.model, small_detector.config
    images = [resize_image(make_image(i, h, w), 64, 96) for i, (h, w) in enumerate([(70, 50), (50, 90)])]
    batch, sizes = batch_images(images, cfg.pixel_mean, cfg.pixel_std, torch.device("cpu"))
    with torch.inference_mode():
        outputs = model(batch, sizes)
        feats = model.backbone(batch, sizes)
        proposals = model.proposal_generator(feats, model.backbone.output_sizes(sizes), sizes)
        heads = model.roi_heads(feats, [boxes for boxes, _ in proposals])
    for out, (boxes, logits), head in zip(outputs, proposals, heads, strict=True):
        assert torch.equal(out.proposals, boxes) and torch.equal(out.objectness, logits)
        assert bool((out.objectness[:-1] >= out.objectness[1:]).all())  # NMS order: best first
        for name in ("features", "cls_logits", "deltas", "attr_logits"):
            assert torch.equal(getattr(out, name), getattr(head, name)), name
