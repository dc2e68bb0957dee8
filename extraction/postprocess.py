"""Network outputs -> stored records: decode scores and boxes, select the regions, rescale to the image;
or a grid's cells with their predicted labels."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from extraction.backbone import upload
from extraction.box_coder import BoxCoder, clip_boxes, clip_boxes_to
from extraction.grid import GridConfig, GridOutputs
from extraction.rcnn import CanvasOutputs, ImageOutputs
from extraction.selection import (
    RULES,
    Selection,
    SelectionConfig,
    select,
    select_caffe_batched,
    select_caffe_padded,
)
from storage import RegionFeatures


@dataclass
class Decoded:
    """One image's class probabilities (R, C+1) and, when asked for, its class-specific regressed boxes
    (R, C, 4) clipped to the network input."""

    probs: torch.Tensor
    boxes: torch.Tensor | None


def decode(out: ImageOutputs, input_hw: tuple[int, int], coder: BoxCoder, with_boxes: bool) -> Decoded:
    probs = F.softmax(out.cls_logits, dim=-1)
    if not with_boxes:
        return Decoded(probs, None)
    num_classes = out.cls_logits.shape[1] - 1
    boxes = coder.decode(out.deltas, out.proposals).view(-1, num_classes, 4)
    return Decoded(probs, clip_boxes(boxes, *input_hw))


# Per selection rule, whether the attribute softmax includes "no attribute" (the last logit), as the rule's
# source computes it: caffe's generate_tsv softmaxes all A+1 and then drops "no attribute";
# py-bottom-up-attention (maxnms, and its detectron2 inference that the threshold rule follows) drops the
# "no attribute" logit and softmaxes over the A real attributes.
ATTRIBUTE_SOFTMAX_WITH_NONE: dict[str, bool] = {"caffe": True, "maxnms": False, "threshold": False}


def attribute_confidence(attr_logits: torch.Tensor, rule: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence, id) of the best real attribute of each region (R, A+1 logits, "no attribute" last),
    in the convention of the selection rule's source (ATTRIBUTE_SOFTMAX_WITH_NONE)."""
    if ATTRIBUTE_SOFTMAX_WITH_NONE[rule]:
        return F.softmax(attr_logits, dim=-1)[..., :-1].max(dim=-1)
    return F.softmax(attr_logits[..., :-1], dim=-1).max(dim=-1)


def rescale(boxes: torch.Tensor, input_hw: tuple[int, int], orig_hw: tuple[int, int]) -> torch.Tensor:
    """Boxes in network-input pixels -> original pixels, scaled per axis and clipped (detectron2's
    detector_postprocess)."""
    orig_h, orig_w = orig_hw
    scale = torch.tensor([orig_w / input_hw[1], orig_h / input_hw[0]] * 2, device=boxes.device)
    return clip_boxes(boxes * scale, orig_h, orig_w)


def to_record(
    out: ImageOutputs,
    img_id: str,
    orig_hw: tuple[int, int],
    input_hw: tuple[int, int],
    selection: SelectionConfig,
    coder: BoxCoder,
) -> RegionFeatures:
    """The regions `selection` keeps, with their features, labels and boxes in original pixels."""
    decoded = decode(out, input_hw, coder, RULES[selection.rule].needs_boxes)
    chosen = select(out.proposals, decoded.probs, decoded.boxes, selection)
    return _region_record(out, decoded, chosen, img_id, orig_hw, input_hw, selection)


def to_records(
    outs: list[ImageOutputs],
    img_ids: list[str],
    orig_hws: list[tuple[int, int]],
    input_hws: list[tuple[int, int]],
    selection: SelectionConfig,
    coder: BoxCoder,
    batched_selection: bool | None = None,
) -> list[RegionFeatures]:
    """`to_record` of each image. With `batched_selection` (default: on accelerators) the caffe rule selects
    for all of them at once (`select_caffe_batched`: fixed shapes, one host sync, the same bits); on a CPU
    the per-image loop is the faster (1.2-2.1 ms against 53-57 ms per image at 300 x 1601, BENCHMARKS.md).
    The other rules select image by image."""
    decoded = [
        decode(out, hw, coder, RULES[selection.rule].needs_boxes)
        for out, hw in zip(outs, input_hws, strict=True)
    ]
    if batched_selection is None:
        batched_selection = bool(outs) and outs[0].proposals.device.type != "cpu"
    if selection.rule == "caffe" and batched_selection:
        chosen = select_caffe_batched([o.proposals for o in outs], [d.probs for d in decoded], selection)
    else:
        chosen = [
            select(o.proposals, d.probs, d.boxes, selection) for o, d in zip(outs, decoded, strict=True)
        ]
    return [
        _region_record(*fields, selection)
        for fields in zip(outs, decoded, chosen, img_ids, orig_hws, input_hws, strict=True)
    ]


def _region_record(
    out: ImageOutputs,
    decoded: Decoded,
    chosen: Selection,
    img_id: str,
    orig_hw: tuple[int, int],
    input_hw: tuple[int, int],
    selection: SelectionConfig,
) -> RegionFeatures:
    attrs_conf, attrs_id = attribute_confidence(out.attr_logits[chosen.index], selection.rule)
    orig_h, orig_w = orig_hw
    return RegionFeatures(
        img_id=img_id,
        img_h=int(orig_h),
        img_w=int(orig_w),
        boxes=_numpy(rescale(chosen.boxes, input_hw, orig_hw), np.float32),
        features=_numpy(out.features[chosen.index], np.float32),
        objects_id=_numpy(chosen.classes, np.int64),
        objects_conf=_numpy(chosen.scores, np.float32),
        attrs_id=_numpy(attrs_id, np.int64),
        attrs_conf=_numpy(attrs_conf, np.float32),
        class_probs=_numpy(decoded.probs[chosen.index], np.float32) if selection.class_probs else None,
    )


def padded_regions(
    out: CanvasOutputs,
    n: int,
    input_hws: list[tuple[int, int]],
    orig_hws: list[tuple[int, int]],
    selection: SelectionConfig,
) -> dict[str, torch.Tensor]:
    """The caffe rule's regions of a canvas batch's first `n` slots, gathered on the device on fixed shapes
    without a host sync: each record field (n, K, ...) and `count` (n,); image i's record holds the first
    count[i] rows, the bits `to_record` writes."""
    probs = F.softmax(out.cls_logits[:n], dim=-1)
    rows, count = select_caffe_padded(out.proposals[:n], probs, out.valid[:n], selection)

    def take(t: torch.Tensor) -> torch.Tensor:
        return t[:n].gather(1, rows[..., None].expand(-1, -1, t.shape[-1]))

    scores, classes = take(probs)[..., :-1].max(dim=-1)
    # per image: the x and y scales (`rescale`, float32 as there) and the original size, in one copy up
    pairs = zip(input_hws, orig_hws, strict=True)
    sizes = [[ow / iw, oh / ih, ow / iw, oh / ih, oh, ow] for (ih, iw), (oh, ow) in pairs]
    sizes = upload(torch.tensor(sizes, dtype=torch.float32), probs.device)[:, None]
    attrs_conf, attrs_id = attribute_confidence(take(out.attr_logits), selection.rule)
    fields = {
        "boxes": clip_boxes_to(take(out.proposals) * sizes[..., :4], sizes[..., 4:]),
        "features": take(out.features),
        "objects_id": classes,
        "objects_conf": scores,
        "attrs_id": attrs_id,
        "attrs_conf": attrs_conf,
        "count": count,
    }
    if selection.class_probs:
        fields["class_probs"] = take(probs)
    return fields


def download(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, np.ndarray]]:
    """Device tensors to host arrays in one copy: every tensor's bytes in one buffer."""
    if not batches:
        return []
    flat = [t.reshape(-1).view(torch.uint8) for fields in batches for t in fields.values()]
    data = torch.cat(flat).cpu().numpy()  # the one host sync
    host, offset = [], 0
    for fields in batches:
        arrays = {}
        for name, t in fields.items():
            size = t.numel() * t.element_size()
            dtype = np.dtype(str(t.dtype).removeprefix("torch."))
            arrays[name] = data[offset : offset + size].view(dtype).reshape(t.shape)
            offset += size
        host.append(arrays)
    return host


def padded_records(
    fields: dict[str, np.ndarray],
    img_ids: list[str],
    orig_hws: list[tuple[int, int]],
) -> list[RegionFeatures]:
    """The records of `padded_regions`' downloaded fields."""
    records = []
    for i, (img_id, (h, w)) in enumerate(zip(img_ids, orig_hws, strict=True)):
        n = int(fields["count"][i])
        probs = fields.get("class_probs")
        records.append(
            RegionFeatures(
                img_id=img_id,
                img_h=int(h),
                img_w=int(w),
                boxes=fields["boxes"][i, :n].astype(np.float32),
                features=fields["features"][i, :n].astype(np.float32),
                objects_id=fields["objects_id"][i, :n].astype(np.int64),
                objects_conf=fields["objects_conf"][i, :n].astype(np.float32),
                attrs_id=fields["attrs_id"][i, :n].astype(np.int64),
                attrs_conf=fields["attrs_conf"][i, :n].astype(np.float32),
                class_probs=probs[i, :n].astype(np.float32) if probs is not None else None,
            )
        )
    return records


def to_grid_record(
    out: GridOutputs,
    img_id: str,
    orig_hw: tuple[int, int],
    input_hw: tuple[int, int],
    grid: GridConfig,
    attribute_rule: str,
    class_probs: bool,
) -> RegionFeatures:
    """The cells as a stored record: boxes = cells in original pixels, labels = the predictor's best
    foreground class and attribute (in `attribute_rule`'s softmax convention, as regions are)."""
    probs = F.softmax(out.cls_logits, dim=-1)
    conf, classes = probs[:, :-1].max(dim=1)
    attrs_conf, attrs_id = attribute_confidence(out.attr_logits, attribute_rule)
    return RegionFeatures(
        img_id=img_id,
        img_h=int(orig_hw[0]),
        img_w=int(orig_hw[1]),
        boxes=grid.cell_boxes(out.map_hw, input_hw, orig_hw),
        features=_numpy(out.features, np.float32),
        objects_id=_numpy(classes, np.int64),
        objects_conf=_numpy(conf, np.float32),
        attrs_id=_numpy(attrs_id, np.int64),
        attrs_conf=_numpy(attrs_conf, np.float32),
        class_probs=_numpy(probs, np.float32) if class_probs else None,
    )


def _numpy(x: torch.Tensor, dtype: type) -> np.ndarray:
    return x.cpu().numpy().astype(dtype)


@dataclass
class Detections:
    """One image's detections in network-input pixels: boxes (D, 4), scores (D,), classes (D,) 0..C-1."""

    boxes: torch.Tensor
    scores: torch.Tensor
    classes: torch.Tensor


def detections(
    out: ImageOutputs,
    input_hw: tuple[int, int],
    coder: BoxCoder,
    score_thresh: float = 0.05,
    nms_thresh: float = 0.5,
    topk: int = 100,
) -> Detections:
    """detectron2's fast_rcnn_inference for one image: every (proposal, class) pair scoring above
    `score_thresh` with that class's regressed box, per-class NMS, the `topk` best (its test defaults)."""
    from torchvision.ops import batched_nms

    decoded = decode(out, input_hw, coder, with_boxes=True)
    probs = decoded.probs[:, :-1]
    keep = probs > score_thresh
    rows, classes = keep.nonzero(as_tuple=True)
    boxes, scores = decoded.boxes[rows, classes], probs[rows, classes]
    finite = torch.isfinite(boxes).all(dim=1) & torch.isfinite(scores)
    boxes, scores, classes = boxes[finite], scores[finite], classes[finite]
    kept = batched_nms(boxes, scores, classes, nms_thresh)[:topk]
    return Detections(boxes[kept], scores[kept], classes[kept])
