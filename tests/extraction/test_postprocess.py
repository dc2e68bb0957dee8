"""Post-processing: probabilities, regressed boxes, the chosen regions' labels and detectron2's rescale."""

from __future__ import annotations

import math

import numpy as np
import torch

from extraction.box_coder import BoxCoder
from extraction.postprocess import decode, rescale, to_record
from extraction.rcnn import ImageOutputs
from extraction.selection import SelectionConfig

CODER = BoxCoder((10.0, 10.0, 5.0, 5.0))


def outputs() -> ImageOutputs:
    """3 proposals, 2 classes (+ background), 2 attributes (+ none, which always scores highest)."""
    proposals = torch.tensor([[10.0, 10.0, 30.0, 50.0], [60.0, 0.0, 90.0, 20.0], [0.0, 40.0, 20.0, 64.0]])
    cls_logits = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.5, 0.2, 0.0]])
    deltas = torch.zeros(3, 8)
    deltas[1, 4:] = torch.tensor([10.0, 0.0, 5 * math.log(2.0), 0.0])  # class 1: shift by w, double w
    attr_logits = torch.tensor([[1.0, 0.0, 9.0], [0.0, 2.0, 9.0], [0.3, 0.1, 9.0]])
    features = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)
    return ImageOutputs(proposals, torch.tensor([3.0, 2.0, 1.0]), features, cls_logits, deltas, attr_logits)


def test_rescale_is_detectron2_detector_postprocess():
    boxes = torch.tensor([[10.0, 20.0, 95.0, 60.0], [-3.0, 5.0, 40.0, 70.0]])
    got = rescale(boxes, (64, 96), (480, 640))
    sx, sy = 640 / 96, 480 / 64
    want = np.array([[10 * sx, 20 * sy, 95 * sx, 60 * sy], [0.0, 5 * sy, 40 * sx, 480.0]], np.float32)
    np.testing.assert_allclose(got.numpy(), np.minimum(want, [640, 480, 640, 480]), rtol=1e-6)


def test_decode_gives_softmax_and_clipped_class_boxes_only_when_asked():
    out = outputs()
    plain = decode(out, (64, 96), CODER, with_boxes=False)
    assert plain.boxes is None
    torch.testing.assert_close(plain.probs, torch.softmax(out.cls_logits, dim=1))
    boxes = decode(out, (64, 96), CODER, with_boxes=True).boxes
    assert boxes.shape == (3, 2, 4)
    torch.testing.assert_close(boxes[0, 0], out.proposals[0])  # zero deltas: the proposal itself
    # proposal 1 (60..90 x 0..20), class 1: centre 75 + 30 -> 105, width 60 -> 75..135, clipped at 96
    torch.testing.assert_close(boxes[1, 1], torch.tensor([75.0, 0.0, 96.0, 20.0]))


def test_record_of_the_caffe_rule():
    out = outputs()
    rec = to_record(out, "img", (128, 192), (64, 96), SelectionConfig("caffe", 1, 2, conf_thresh=0.5), CODER)
    rec.validate(feature_dim=4, max_boxes=2)
    assert (rec.img_id, rec.img_h, rec.img_w) == ("img", 128, 192)
    # proposals 0 and 1 reach 0.5 for class 0 and 1; proposal 2 does not
    assert rec.objects_id.tolist() == [0, 1]
    np.testing.assert_array_equal(rec.features, out.features[:2].numpy())
    np.testing.assert_allclose(rec.boxes, 2 * out.proposals[:2].numpy())  # unregressed, x2 per axis
    probs = torch.softmax(out.cls_logits, dim=1)
    np.testing.assert_allclose(rec.objects_conf, [probs[0, 0], probs[1, 1]], rtol=1e-6)
    # "no attribute" scores highest everywhere and is never chosen; the probability is over all 3
    assert rec.attrs_id.tolist() == [0, 1]
    attrs = torch.softmax(out.attr_logits, dim=1)
    np.testing.assert_allclose(rec.attrs_conf, [attrs[0, 0], attrs[1, 1]], rtol=1e-6)


def test_record_of_the_maxnms_rule_uses_regressed_boxes():
    out = outputs()
    rec = to_record(out, "img", (64, 96), (64, 96), SelectionConfig("maxnms", 3, 3), CODER)
    assert rec.num_boxes == 3 and rec.objects_id.tolist() == [0, 1, 0]  # by score: 0, 1, 2
    np.testing.assert_allclose(rec.boxes[1], [75.0, 0.0, 96.0, 20.0])
    np.testing.assert_array_equal(rec.features, out.features.numpy())
