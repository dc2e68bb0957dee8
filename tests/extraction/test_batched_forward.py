"""The batched forward (padded canvases, one RoI-head call per batch): an image's record is bit for bit the
same alone or in any batch, equals the per-image forward up to rounding, its batched selection writes the
per-image selection's records, and the `forward` setting and the convolution layout choice behave as
documented."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from extraction import Detector, rcnn
from extraction.backbone import conv_memory_format, set_memory_format, trunk_extents
from extraction.config import SMALL_PRESET
from extraction.grid import GridConfig
from extraction.postprocess import to_record, to_records
from extraction.preprocess import batch_images, resize_image

FIELDS = ("boxes", "features", "objects_id", "objects_conf", "attrs_id", "attrs_conf")
ROI_FIELDS = ("proposals", "objectness", "features", "cls_logits", "deltas", "attr_logits")  # per proposal
SHAPES = ((60, 90), (90, 60), (70, 70), (64, 96), (100, 80))  # three canvases at CANVAS_STEP 32


@pytest.fixture()
def small_canvases(monkeypatch):
    """Canvases of 32 px steps: the small test images fall into several size buckets."""
    monkeypatch.setattr(rcnn, "CANVAS_STEP", 32)


def _variant(det: Detector, **changes) -> Detector:
    """The same network and weights with other `Detector` settings."""
    fields = dict(
        selection=det.selection,
        preset=det.preset,
        weights=det._weights,
        grid=det.grid,
        forward=det.forward,
        forward_batch=det.forward_batch,
        fixed_shapes=det.fixed_shapes,
    )
    fields.update(changes)
    return Detector(det.model, det.config, **fields)


def _same(a, b) -> bool:
    return a.img_id == b.img_id and all(np.array_equal(getattr(a, f), getattr(b, f)) for f in FIELDS)


@pytest.fixture(scope="module")
def small_detector() -> Detector:
    """The small C4 network (random weights) at 64..96 px with 8 proposals: seconds on 2 cores."""
    torch.set_num_threads(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Detector.build(
            SMALL_PRESET, min_boxes=2, max_boxes=6, min_size=64, max_size=96, post_nms_topk=8
        )


@pytest.fixture(scope="module")
def images(make_image) -> list[np.ndarray]:
    return [make_image(40 + i, h, w) for i, (h, w) in enumerate(SHAPES)]


def test_a_record_is_bitwise_the_same_alone_or_in_any_batch(small_detector, images, small_canvases):
    det = _variant(small_detector, forward="batched", forward_batch=3)
    assert det.forward_path == "batched"
    ids = [f"im{i}" for i in range(len(images))]
    alone = [det.detect([im], [i])[0] for im, i in zip(images, ids, strict=True)]
    orders = ([4, 0, 2, 1, 3], [1, 1, 3, 0], [3, 2])  # several buckets, repeats, more than one call
    for order in orders:
        got = det.detect([images[k] for k in order], [ids[k] for k in order])
        for k, rec in zip(order, got, strict=True):
            assert _same(rec, alone[k]), (order, k)


def test_batched_equals_the_per_image_forward_up_to_rounding(small_detector, images, small_canvases):
    """The canvas masks make each convolution read zeros beyond its image, as its padding does alone: the
    network's outputs agree to rounding (an unmasked canvas moves border activations by O(1))."""
    cfg, model = small_detector.config, small_detector.model
    inputs = [
        batch_images(
            [resize_image(im, cfg.min_size, cfg.max_size)], cfg.pixel_mean, cfg.pixel_std, torch.device("cpu")
        )[0][0]
        for im in images
    ]
    with torch.inference_mode():
        ref = model(inputs)
        got = model.forward_batched(inputs, batch_size=4)
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g.proposals, r.proposals, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(g.features, r.features, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(g.cls_logits, r.cls_logits, rtol=1e-4, atol=1e-5)


def test_canvases_follow_the_orientation_and_fall_back_to_rounded_sides():
    assert rcnn.canvas_of(600, 800, (600, 1000)) == (600, 1000)
    assert rcnn.canvas_of(1000, 563, (600, 1000)) == (1000, 600)
    assert rcnn.canvas_of(600, 600, (600, 1000)) == (600, 1000)
    assert rcnn.canvas_of(700, 800, (600, 1000)) == (768, 896)  # does not fit: its own, rounded up
    assert rcnn.canvas_of(70, 70) == (128, 128)


def test_trunk_extents_are_the_per_image_res4_size(small_detector):
    backbone = small_detector.model.backbone
    with torch.inference_mode():
        for h, w in ((33, 47), (64, 96), (65, 95), (128, 31)):
            assert trunk_extents(h, w)[-1] == tuple(backbone(torch.zeros(1, 3, h, w)).shape[-2:])


def test_grid_cells_are_bitwise_the_same_alone_or_in_a_batch(images, small_canvases):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = Detector.build(SMALL_PRESET, grid="3x5", min_size=64, max_size=96)
    for spec in ("3x5", "native/1@32"):
        per_image = _variant(base, grid=GridConfig.parse(spec), forward="per-image")
        batched = _variant(per_image, forward="batched", forward_batch=2)
        alone = [batched.detect([im], ["x"])[0] for im in images]
        together = batched.detect(images, ["x"] * len(images))
        reference = per_image.detect(images, ["x"] * len(images))
        for a, t, r in zip(alone, together, reference, strict=True):
            assert _same(a, t), spec
            np.testing.assert_allclose(t.features, r.features, rtol=1e-4, atol=1e-5)


def test_forward_setting_is_checked_and_auto_depends_on_the_device(small_detector):
    assert _variant(small_detector, forward="auto").forward_path == "per-image"  # on CPU
    assert rcnn.forward_path("auto", torch.device("cuda")) == "batched"
    assert rcnn.forward_path("per-image", torch.device("cuda")) == "per-image"
    with pytest.raises(ValueError, match="forward must be one of per-image, batched, auto; got 'fast'"):
        _variant(small_detector, forward="fast")
    with pytest.raises(ValueError, match="forward must be one of"):
        Detector.build(forward="batch")
    with pytest.raises(ValueError, match="forward_batch"):
        _variant(small_detector, forward_batch=0)


def test_float32_on_cuda_runs_nchw_and_the_layout_moves_only_rounding(small_detector, images):
    assert conv_memory_format(torch.device("cuda"), "float32") == torch.contiguous_format
    assert conv_memory_format(torch.device("cuda"), "bfloat16") == torch.channels_last
    assert conv_memory_format(torch.device("cpu"), "float32") == torch.channels_last
    model = small_detector.model
    conv = model.roi_heads.res5[0].conv2
    assert conv.folded_weight.is_contiguous(memory_format=torch.channels_last)
    cfg = small_detector.config
    x = batch_images(
        [resize_image(images[0], cfg.min_size, cfg.max_size)],
        cfg.pixel_mean,
        cfg.pixel_std,
        torch.device("cpu"),
    )[0]
    with torch.inference_mode():
        ref = model([x[0]])[0]
        set_memory_format(model, torch.contiguous_format)
        try:
            assert (
                conv.folded_weight.is_contiguous()
                and model.roi_heads.memory_format == torch.contiguous_format
            )
            got = model([x[0]])[0]
        finally:
            set_memory_format(model, torch.channels_last)
    assert conv.folded_weight.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(got.features, ref.features, rtol=1e-4, atol=1e-5)


def test_batched_selection_gives_the_per_image_records(small_detector, images):
    """`to_records` (the batched path's caffe selection, one host sync per batch) writes the records the
    per-image `to_record` writes, bit for bit, for images with fewer proposals than their batch-mates too."""
    cfg, model = small_detector.config, small_detector.model
    resized = [resize_image(im, cfg.min_size, cfg.max_size) for im in images]
    inputs = [batch_images([im], cfg.pixel_mean, cfg.pixel_std, torch.device("cpu"))[0][0] for im in resized]
    with torch.inference_mode():
        outs = model.forward_batched(inputs, batch_size=4)
    outs[1] = dataclasses.replace(outs[1], **{f: getattr(outs[1], f)[:3] for f in ROI_FIELDS})
    outs[3] = dataclasses.replace(outs[3], **{f: getattr(outs[3], f)[:0] for f in ROI_FIELDS})
    ids = [f"im{i}" for i in range(len(outs))]
    input_hws = [im.shape[:2] for im in resized]
    orig_hws = [im.shape[:2] for im in images]
    coder = small_detector._roi_coder
    settings = ({}, {"min_boxes": 36, "max_boxes": 36}, {"conf_thresh": 0.0, "class_probs": True})
    for changes in (*settings, {"rule": "maxnms"}, {"rule": "threshold"}):
        sel = dataclasses.replace(small_detector.selection, **changes)
        got = to_records(outs, ids, orig_hws, input_hws, sel, coder, batched_selection=True)
        want = [to_record(*args, sel, coder) for args in zip(outs, ids, orig_hws, input_hws, strict=True)]
        for g, w in zip(got, want, strict=True):
            assert _same(g, w) and np.array_equal(g.class_probs, w.class_probs), (changes, g.img_id)


def test_regions_gathered_on_the_device_are_the_per_image_selection_records(small_detector, images):
    """The batched path's caffe regions, selected and gathered on fixed shapes and downloaded in one copy,
    are bit for bit the records the per-image selection writes from the same network outputs."""
    base = _variant(small_detector, forward="batched", forward_batch=4)
    ids = [f"im{i}" for i in range(len(images))]
    settings = ({}, {"min_boxes": 36, "max_boxes": 36}, {"conf_thresh": 0.0, "class_probs": True})
    for changes in settings:
        sel = dataclasses.replace(small_detector.selection, **changes)
        got = _variant(base, selection=sel, fixed_shapes=True).detect(images, ids)
        want = _variant(base, selection=sel, fixed_shapes=False).detect(images, ids)
        for g, w in zip(got, want, strict=True):
            assert _same(g, w), (changes, g.img_id)
            assert (g.class_probs is None) == (w.class_probs is None)
            assert g.class_probs is None or np.array_equal(g.class_probs, w.class_probs)


def test_batched_proposals_are_each_slots_own_proposals(small_detector, images, small_canvases):
    """`RPN.proposals_batched` (masked scores, fixed-step greedy NMS, or torchvision's slot by slot) gives
    each slot what `RPN.proposals` gives for the slot's own part of the canvas, bit for bit."""
    cfg, model = small_detector.config, small_detector.model
    rpn = model.proposal_generator
    inputs = [
        batch_images(
            [resize_image(im, cfg.min_size, cfg.max_size)], cfg.pixel_mean, cfg.pixel_std, torch.device("cpu")
        )[0][0]
        for im in images
    ]
    for canvas, idx in rcnn.canvas_batches(inputs, 4, (cfg.min_size, cfg.max_size)):
        with torch.inference_mode():
            res4, mask = model._canvas_trunk(inputs, idx, canvas, 4)
            logits, deltas = rpn.rpn_head(res4.contiguous())
            extents, sizes = (mask.on(hw, res4.device) for hw in (tuple(res4.shape[-2:]), canvas))
            for fixed in (True, False):
                boxes, scores, valid = rpn.proposals_batched(logits, deltas, extents, sizes, fixed)
                for slot, i in enumerate(idx):
                    fh, fw = mask.at(tuple(res4.shape[-2:]))[slot]
                    s, d = rpn.flatten(
                        logits[slot : slot + 1, :, :fh, :fw], deltas[slot : slot + 1, :, :fh, :fw]
                    )
                    want_boxes, want_scores = rpn.proposals(s, d, (fh, fw), tuple(inputs[i].shape[-2:]))
                    n = want_boxes.shape[0]
                    assert valid[slot, :n].all() and not valid[slot, n:].any()
                    assert torch.equal(boxes[slot, :n], want_boxes) and torch.equal(
                        scores[slot, :n], want_scores
                    )
                assert not valid[len(idx) :].any()  # blank slots
