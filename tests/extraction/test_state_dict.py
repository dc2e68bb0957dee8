"""The network's state-dict names and shapes are detectron2's R-101-C4 VG layout, plus the attribute head."""

from __future__ import annotations

import ast

import torch

from extraction.config import DetectorConfig
from extraction.rcnn import VGFasterRCNN


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


def model_keys() -> list[tuple[str, tuple]]:
    with torch.device("meta"):
        model = VGFasterRCNN(DetectorConfig())
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def test_state_dict_matches_stage_layout():
    ours, expected = model_keys(), expected_keys()
    assert len(expected) == 535
    assert sorted(set(ours) - set(expected)) == [] and sorted(set(expected) - set(ours)) == []
    assert ours == expected


def test_state_dict_matches_shared_reference(shared_reference):
    ref = []
    for line in (shared_reference / "detectron2_r101_c4_vg_keys.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, shape = line.split(" ", 1)
            ref.append((name, tuple(ast.literal_eval(shape))))
    assert dict(model_keys()) == dict(ref)


def test_anchor_buffer_is_not_saved():
    names = {k for k, _ in model_keys()}
    assert not any("anchor_generator" in n for n in names)
