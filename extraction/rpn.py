"""Region proposal network: 3x3 conv head on res4, detectron2's proposal filtering, and in training its
anchor labelling (IoU 0.3 / 0.7 with low-quality matches), anchor sampling and losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import box_iou, nms

from extraction.anchors import AnchorGenerator
from extraction.box_coder import BoxCoder, clip_boxes, clip_boxes_to, nonempty
from extraction.sampling import IGNORE, Matcher, subsample_labels


class RPNHead(nn.Module):
    """conv 3x3 + ReLU, then per-anchor objectness logits and box deltas."""

    def __init__(self, in_ch: int, conv_ch: int, num_anchors: int):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, conv_ch, kernel_size=3, stride=1, padding=1)
        self.objectness_logits = nn.Conv2d(conv_ch, num_anchors, kernel_size=1)
        self.anchor_deltas = nn.Conv2d(conv_ch, num_anchors * 4, kernel_size=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = F.relu(self.conv(x))
        return self.objectness_logits(t), self.anchor_deltas(t)


class RPN(nn.Module):
    """Proposals per image: top-k logits -> decode -> clip -> drop empty -> NMS -> top-k."""

    def __init__(
        self,
        in_ch: int,
        conv_ch: int,
        anchor_sizes: tuple[float, ...],
        anchor_ratios: tuple[float, ...],
        pre_nms_topk: int,
        post_nms_topk: int,
        nms_thresh: float,
    ):
        super().__init__()
        self.anchor_generator = AnchorGenerator(anchor_sizes, anchor_ratios)
        self.rpn_head = RPNHead(in_ch, conv_ch, self.anchor_generator.num_anchors)
        self.box_coder = BoxCoder((1.0, 1.0, 1.0, 1.0))
        self.pre_nms_topk = pre_nms_topk
        self.post_nms_topk = post_nms_topk
        self.nms_thresh = nms_thresh

    def forward(self, features: torch.Tensor, image_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's res4 map (1, C, h, w) -> (proposal boxes (R, 4) in input pixels, objectness (R,))."""
        logits, deltas = self.head_outputs(features)
        return self.proposals(logits, deltas, features.shape[-2:], image_hw)

    def head_outputs(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-anchor objectness logits (A,) and deltas (A, 4), flattened (y, x, anchor) like detectron2."""
        # the head's weights are plain NCHW (a layout mixed with channels-last inputs runs slowest)
        return self.flatten(*self.rpn_head(features.contiguous()))

    def flatten(self, logits: torch.Tensor, deltas: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's head outputs ((1, A, h, w) logits, (1, 4A, h, w) deltas) flattened as head_outputs."""
        num_anchors = self.anchor_generator.num_anchors
        fh, fw = logits.shape[-2:]
        scores = logits[0].permute(1, 2, 0).reshape(-1).float()
        d = deltas[0].reshape(num_anchors, 4, fh, fw).permute(2, 3, 0, 1).reshape(-1, 4).float()
        return scores, d

    def proposals(
        self,
        scores: torch.Tensor,
        deltas: torch.Tensor,
        grid_hw: tuple[int, int],
        image_hw: tuple[int, int],
        pre_nms_topk: int | None = None,
        post_nms_topk: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """top-k logits -> decode -> clip -> drop empty -> NMS -> top-k (the test-time k unless given)."""
        pre = pre_nms_topk or self.pre_nms_topk
        post = post_nms_topk or self.post_nms_topk
        scores, idx = scores.topk(min(pre, scores.numel()))
        anchors = self.anchor_generator(*grid_hw)
        boxes = self.box_coder.decode(deltas[idx], anchors[idx])
        finite = torch.isfinite(boxes).all(dim=1) & torch.isfinite(scores)
        boxes, scores = boxes[finite], scores[finite]
        boxes = clip_boxes(boxes, *image_hw)
        keep = nonempty(boxes)
        boxes, scores = boxes[keep], scores[keep]
        keep = nms(boxes, scores, self.nms_thresh)[:post]
        return boxes[keep], scores[keep]

    def proposals_batched(
        self,
        logits: torch.Tensor,
        deltas: torch.Tensor,
        extents: torch.Tensor,
        image_hws: torch.Tensor,
        fixed_shapes: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`proposals` of every slot of a canvas batch on fixed shapes, without a host sync: head outputs
        (B, A, H, W) and (B, 4A, H, W), each slot's res4 extent and input size (B, 2) as (h, w) -> boxes
        (B, post, 4), objectness (B, post) and valid (B, post); a slot's first valid rows are what
        `proposals` gives for its own map (the same arithmetic; rows past them are zeros). Without
        `fixed_shapes` the NMS is torchvision's, slot by slot (host syncs, but a CPU builds no IoU matrix)."""
        b, num_anchors = logits.shape[0], self.anchor_generator.num_anchors
        gh, gw = logits.shape[-2:]
        scores = logits.permute(0, 2, 3, 1).reshape(b, -1).float()
        d = deltas.view(b, num_anchors, 4, gh, gw).permute(0, 3, 4, 1, 2).reshape(b, -1, 4).float()
        ys = torch.arange(gh, device=logits.device)[None, :, None] < extents[:, :1, None]
        xs = torch.arange(gw, device=logits.device)[None, None, :] < extents[:, 1:, None]
        inside = (ys & xs)[..., None].expand(b, gh, gw, num_anchors).reshape(b, -1)
        # anchors beyond a slot's own map rank last (an image's own anchors come first, in its order)
        scores, idx = scores.masked_fill(~inside, -torch.inf).topk(min(self.pre_nms_topk, scores.shape[1]))
        anchors = self.anchor_generator(gh, gw)[idx]
        boxes = self.box_coder.decode(
            d.gather(1, idx[..., None].expand(-1, -1, 4)).view(-1, 4), anchors.view(-1, 4)
        )
        boxes = boxes.view(b, -1, 4)
        valid = inside.gather(1, idx) & torch.isfinite(boxes).all(dim=2) & torch.isfinite(scores)
        boxes = clip_boxes_to(boxes, image_hws[:, None])
        valid &= (boxes[..., 2] > boxes[..., 0]) & (boxes[..., 3] > boxes[..., 1])
        k = boxes.shape[1]
        if fixed_shapes:
            keep = greedy_nms(boxes, valid, self.nms_thresh, self.post_nms_topk)  # (B, post), k = none
        else:
            keep = boxes.new_full((b, self.post_nms_topk), k, dtype=torch.int64)
            for slot in range(b):
                rows = valid[slot].nonzero()[:, 0]
                kept = rows[nms(boxes[slot, rows], scores[slot, rows], self.nms_thresh)[: self.post_nms_topk]]
                keep[slot, : kept.shape[0]] = kept
        boxes = torch.cat([boxes, boxes.new_zeros(b, 1, 4)], 1).gather(1, keep[..., None].expand(-1, -1, 4))
        scores = torch.cat([scores, scores.new_zeros(b, 1)], 1).gather(1, keep)
        return boxes, scores, keep < k

    def label_anchors(
        self,
        anchors: torch.Tensor,
        gt_boxes: torch.Tensor,
        matcher: Matcher,
        batch_size: int,
        positive_fraction: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(label per anchor: 1 sampled positive, 0 sampled negative, -1 not sampled; matched box (A, 4))."""
        matches, labels = matcher(box_iou(gt_boxes, anchors))
        labels = labels.to(torch.int64)
        pos, neg = subsample_labels(labels, batch_size, positive_fraction, 0, generator)
        labels = torch.full_like(labels, IGNORE)
        labels[pos], labels[neg] = 1, 0
        matched = gt_boxes[matches] if gt_boxes.numel() else torch.zeros_like(anchors)
        return labels, matched

    def losses(
        self,
        scores: list[torch.Tensor],
        deltas: list[torch.Tensor],
        anchors: list[torch.Tensor],
        labels: list[torch.Tensor],
        matched_boxes: list[torch.Tensor],
        batch_size: int,
    ) -> dict[str, torch.Tensor]:
        """detectron2's RPN losses over a batch of images: objectness BCE over the sampled anchors and L1
        (smooth-L1 with beta 0) on the positives' deltas, both summed and divided by images x batch_size."""
        scores_all, deltas_all, labels_all = torch.cat(scores), torch.cat(deltas), torch.cat(labels)
        pos = labels_all == 1
        valid = labels_all >= 0
        normalizer = batch_size * len(scores)
        # targets for the sampled positives only (a few hundred of the tens of thousands of anchors)
        targets = self.box_coder.encode(torch.cat(anchors)[pos], torch.cat(matched_boxes)[pos])
        loss_loc = F.l1_loss(deltas_all[pos], targets, reduction="sum")
        loss_cls = F.binary_cross_entropy_with_logits(
            scores_all[valid], labels_all[valid].to(scores_all.dtype), reduction="sum"
        )
        return {"loss_rpn_cls": loss_cls / normalizer, "loss_rpn_loc": loss_loc / normalizer}


NMS_ELEMENTS = 1 << 27  # box pairs per pass when the batched proposals' suppression matrix is built


def greedy_nms(boxes: torch.Tensor, valid: torch.Tensor, thresh: float, steps: int) -> torch.Tensor:
    """torchvision `nms` of each image of a batch on fixed shapes: boxes (B, K, 4) sorted by decreasing
    score, valid (B, K) -> the first `steps` kept indices (B, steps), K where an image has no more.

    The IoU is torchvision's CPU arithmetic in float32, so the same boxes survive; the greedy pass is
    `steps` steps of three ops for the whole batch (the next unsuppressed box, its row, OR)."""
    b, k, _ = boxes.shape
    x1, y1, x2, y2 = boxes.unbind(-1)
    area = (x2 - x1) * (y2 - y1)
    # row i: the boxes box i suppresses; row and column K (none) stay clear
    suppresses = boxes.new_zeros((b, k + 1, k + 1), dtype=torch.bool)
    chunk = max(1, NMS_ELEMENTS // max(b * k, 1))
    for s in range(0, k, chunk):
        e = min(s + chunk, k)
        w = (
            torch.minimum(x2[:, s:e, None], x2[:, None]) - torch.maximum(x1[:, s:e, None], x1[:, None])
        ).clamp(min=0)
        h = (
            torch.minimum(y2[:, s:e, None], y2[:, None]) - torch.maximum(y1[:, s:e, None], y1[:, None])
        ).clamp(min=0)
        inter = w * h
        torch.gt(inter / (area[:, s:e, None] + area[:, None] - inter), thresh, out=suppresses[:, s:e, :k])
    suppresses[:, :k, :k].diagonal(dim1=1, dim2=2).fill_(True)  # a kept box is done (at any threshold)
    suppressed = torch.cat([(~valid).to(torch.uint8), valid.new_zeros(b, 1, dtype=torch.uint8)], 1)
    kept = []
    for _ in range(steps):
        pick = suppressed.argmin(1)  # the first box still standing, else K
        kept.append(pick)
        # a gather, not suppresses[batch, pick]: CPU advanced indexing is ~100x slower here
        suppressed |= torch.gather(suppresses, 1, pick[:, None, None].expand(b, 1, k + 1))[:, 0]
    return torch.stack(kept, 1) if kept else boxes.new_zeros((b, 0), dtype=torch.int64)
