"""detectron2's Box2BoxTransform (no "+1" widths, scale clamp) and box clipping."""

from __future__ import annotations

import math

import torch

SCALE_CLAMP = math.log(1000.0 / 16)


class BoxCoder:
    """Decodes (dx, dy, dw, dh) deltas, divided by `weights`, relative to reference boxes (x1, y1, x2, y2)."""

    def __init__(self, weights: tuple[float, float, float, float], scale_clamp: float = SCALE_CLAMP):
        self.weights = weights
        self.scale_clamp = scale_clamp

    def encode(self, boxes: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The (R, 4) deltas that take reference `boxes` to `targets` (detectron2's get_deltas), float32."""
        boxes, targets = boxes.float(), targets.float()
        widths = boxes[:, 2] - boxes[:, 0]
        heights = boxes[:, 3] - boxes[:, 1]
        ctr_x = boxes[:, 0] + 0.5 * widths
        ctr_y = boxes[:, 1] + 0.5 * heights
        t_widths = targets[:, 2] - targets[:, 0]
        t_heights = targets[:, 3] - targets[:, 1]
        t_ctr_x = targets[:, 0] + 0.5 * t_widths
        t_ctr_y = targets[:, 1] + 0.5 * t_heights
        wx, wy, ww, wh = self.weights
        dx = wx * (t_ctr_x - ctr_x) / widths
        dy = wy * (t_ctr_y - ctr_y) / heights
        dw = ww * torch.log(t_widths / widths)
        dh = wh * torch.log(t_heights / heights)
        return torch.stack((dx, dy, dw, dh), dim=1)

    def decode(self, deltas: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        """deltas (R, 4k) for boxes (R, 4) -> (R, 4k) decoded boxes, in float32."""
        deltas = deltas.float()
        boxes = boxes.to(deltas.dtype)
        widths = boxes[:, 2] - boxes[:, 0]
        heights = boxes[:, 3] - boxes[:, 1]
        ctr_x = boxes[:, 0] + 0.5 * widths
        ctr_y = boxes[:, 1] + 0.5 * heights

        wx, wy, ww, wh = self.weights
        dx = deltas[:, 0::4] / wx
        dy = deltas[:, 1::4] / wy
        dw = torch.clamp(deltas[:, 2::4] / ww, max=self.scale_clamp)
        dh = torch.clamp(deltas[:, 3::4] / wh, max=self.scale_clamp)

        pred_ctr_x = dx * widths[:, None] + ctr_x[:, None]
        pred_ctr_y = dy * heights[:, None] + ctr_y[:, None]
        pred_w = torch.exp(dw) * widths[:, None]
        pred_h = torch.exp(dh) * heights[:, None]
        x1 = pred_ctr_x - 0.5 * pred_w
        y1 = pred_ctr_y - 0.5 * pred_h
        x2 = pred_ctr_x + 0.5 * pred_w
        y2 = pred_ctr_y + 0.5 * pred_h
        return torch.stack((x1, y1, x2, y2), dim=-1).reshape(deltas.shape)


def clip_boxes(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Clamp (..., 4) boxes into [0, width] x [0, height]."""
    x1 = boxes[..., 0].clamp(min=0, max=width)
    y1 = boxes[..., 1].clamp(min=0, max=height)
    x2 = boxes[..., 2].clamp(min=0, max=width)
    y2 = boxes[..., 3].clamp(min=0, max=height)
    return torch.stack((x1, y1, x2, y2), dim=-1)


def clip_boxes_to(boxes: torch.Tensor, hw: torch.Tensor) -> torch.Tensor:
    """`clip_boxes` with per-image bounds: hw (..., 2) as (height, width), broadcast against boxes[..., 0]."""
    zero = boxes.new_zeros(())
    h, w = hw[..., 0].to(boxes.dtype), hw[..., 1].to(boxes.dtype)
    return torch.stack(
        (
            boxes[..., 0].clamp(min=zero, max=w),
            boxes[..., 1].clamp(min=zero, max=h),
            boxes[..., 2].clamp(min=zero, max=w),
            boxes[..., 3].clamp(min=zero, max=h),
        ),
        dim=-1,
    )


def nonempty(boxes: torch.Tensor) -> torch.Tensor:
    """Boxes with positive width and height."""
    return (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
