"""Grid features: the detector's res5 run once over the whole res4 map, pooled to cells (Jiang et al.,
"In Defense of Grid Features for VQA", CVPR 2020), each cell stored as a region whose box is the cell."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from extraction.backbone import CanvasMask
from extraction.config import DetectorConfig

FEATURE_KINDS = ("regions", "grid")  # what `xmodal extract --features` writes
DEFAULT_GRID = "14x14"  # Show, Attend and Tell's 196 annotation vectors
MAP_STRIDE = 16  # res4's stride; res5 keeps it (stride 1, dilation 2, as in the caffe model)
# 16: res5 as the caffe model runs it (stride 1, dilation 2), every position of the res4 map.
# 32: res5 with stride 2 and dilation 1, as grid-feats-vqa extracts (RES5_DILATION=1): with the stride on
# the 1x1 convolutions this is exactly every other row and column of the stride-16 map, for a quarter of
# res5's arithmetic.
MAP_STRIDES = (16, 32)
_FIXED = re.compile(r"^(\d+)x(\d+)(?:@(\d+))?$")
_NATIVE = re.compile(r"^native/(\d+)(?:@(\d+))?$")


@dataclass(frozen=True)
class GridConfig:
    """How res5's whole-image map becomes cells: `rows` x `cols` by adaptive average pooling (`14x14`),
    or, with `pool`, the native map average-pooled by `pool` x `pool` windows (`native/2`: stride 32,
    grid-feats-vqa's shape; the last window of a row or column averages what is left). `stride` is the
    res5 map's: 16 (default) or 32 (`@32`, grid-feats-vqa's own extraction; `native/1@32` is their grid)."""

    rows: int = 14
    cols: int = 14
    pool: int | None = None
    stride: int = MAP_STRIDE

    def __post_init__(self) -> None:
        if self.stride not in MAP_STRIDES:
            raise ValueError(f"the res5 map's stride must be one of {MAP_STRIDES}, got {self.stride}")
        if self.pool is not None and self.pool < 1:
            raise ValueError(f"the native map's pooling factor must be at least 1, got {self.pool}")
        if self.pool is None and min(self.rows, self.cols) < 1:
            raise ValueError(f"a grid needs at least one row and column, got {self.rows}x{self.cols}")

    @classmethod
    def parse(cls, spec: str) -> GridConfig:
        """`14x14` (rows x columns) or `native/2` (the native map pooled by 2), each optionally with
        `@32` (res5 at stride 32, grid-feats-vqa's extraction) or `@16` (the default)."""
        text = str(spec).strip().lower()
        if m := _FIXED.match(text):
            return cls(rows=int(m[1]), cols=int(m[2]), stride=int(m[3] or MAP_STRIDE))
        if m := _NATIVE.match(text):
            return cls(pool=int(m[1]), stride=int(m[2] or MAP_STRIDE))
        raise ValueError(
            f"--grid {spec!r} is neither ROWSxCOLS (e.g. 14x14) nor native/K (e.g. native/2), "
            "optionally followed by @32 (res5 at stride 32)"
        )

    @property
    def spec(self) -> str:
        cells = f"native/{self.pool}" if self.pool is not None else f"{self.rows}x{self.cols}"
        return cells if self.stride == MAP_STRIDE else f"{cells}@{self.stride}"

    def max_cells(self, config: DetectorConfig) -> int:
        """The most cells an image can have at the config's input size (a store's max_boxes)."""
        if self.pool is None:
            return self.rows * self.cols
        side = self.pool * self.stride
        return math.ceil(config.min_size / side) * math.ceil(config.max_size / side)

    def describe(self) -> str:
        """How the cells were made, for the store's provenance."""
        if self.pool is None:
            pooling = f"adaptive average pooling to {self.rows}x{self.cols} cells"
        else:
            pooling = f"{self.pool}x{self.pool} average pooling (stride {self.pool * self.stride} px)"
        if self.stride == MAP_STRIDE:
            res5 = f"res5 over the whole res4 map (stride {MAP_STRIDE})"
        else:
            res5 = (
                f"res5 over the whole res4 map at stride {self.stride} (stride 2, dilation 1: every other "
                f"row and column of the stride-{MAP_STRIDE} map)"
            )
        return (
            f"stem->res4 over the whole image, {res5}, "
            f"{pooling}; each cell's class and attributes from the box predictor on its feature"
        )

    def res5_map(
        self, res5: nn.Sequential, res4: torch.Tensor, mask: CanvasMask | None = None
    ) -> torch.Tensor:
        """The RoI head's res5 stage over whole (N, C, H, W) res4 maps, at this grid's stride; `mask` when
        they are padded canvases (backbone.CanvasMask).

        At 32 the stage runs on every other row and column of res4 with its 3x3 convolutions undilated:
        as its stride sits on the first block's 1x1 convolutions, this is exactly the stride-16 map's
        even rows and columns (the zero padding lines up too)."""
        if self.stride == MAP_STRIDE:
            if mask is None:
                return res5(res4)
            for block in res5:
                res4 = block(res4, mask=mask)
            return res4
        step = self.stride // MAP_STRIDE
        dilations = {block.conv2.dilation for block in res5}
        if dilations != {(step, step)}:
            raise ValueError(
                f"--grid {self.spec}: res5 at stride {self.stride} needs the detector's res5_dilation "
                f"{step}, this one has {sorted(d[0] for d in dilations)}; use the stride-16 grid"
            )
        x = res4[:, :, ::step, ::step]
        if mask is not None:
            mask.subsample(tuple(res4.shape[-2:]), step)
        for block in res5:
            x = block(x, dilation=1) if mask is None else block(x, dilation=1, mask=mask)
        return x

    def pool_map(self, res5: torch.Tensor) -> torch.Tensor:
        """(1, D, H, W) res5 map -> (1, D, rows, cols) cell features, float32."""
        x = res5.float().contiguous()
        if self.pool is None:
            return F.adaptive_avg_pool2d(x, (self.rows, self.cols))
        return F.avg_pool2d(x, self.pool, self.pool, ceil_mode=True)

    def cell_boxes(
        self, map_hw: tuple[int, int], input_hw: tuple[int, int], orig_hw: tuple[int, int]
    ) -> np.ndarray:
        """(rows * cols, 4) x1, y1, x2, y2 in original pixels, row-major; the cells tile the image."""
        if self.pool is None:
            ys = np.linspace(0.0, orig_hw[0], self.rows + 1)
            xs = np.linspace(0.0, orig_hw[1], self.cols + 1)
        else:
            ys = _native_edges(map_hw[0], self.pool, self.stride, input_hw[0]) * (orig_hw[0] / input_hw[0])
            xs = _native_edges(map_hw[1], self.pool, self.stride, input_hw[1]) * (orig_hw[1] / input_hw[1])
            ys[-1], xs[-1] = orig_hw  # exact, whatever the rounding of the scale
        y1, x1 = np.meshgrid(ys[:-1], xs[:-1], indexing="ij")
        y2, x2 = np.meshgrid(ys[1:], xs[1:], indexing="ij")
        return np.stack([x1, y1, x2, y2], axis=-1).reshape(-1, 4).astype(np.float32)


def _native_edges(map_size: int, pool: int, stride: int, input_size: int) -> np.ndarray:
    """Input-pixel edges of the pooled native cells along one axis of a stride-`stride` map; the last one
    ends at the image's edge."""
    cells = math.ceil(map_size / pool)
    edges = np.minimum(np.arange(cells + 1, dtype=np.float64) * pool * stride, input_size)
    edges[-1] = input_size
    return edges


@dataclass
class GridOutputs:
    """One image's cells: features (N, D), the box predictor's class (N, C+1) and attribute (N, A+1)
    logits on them, and the res5 map's (H, W) before pooling; all float32, cells row-major."""

    features: torch.Tensor
    cls_logits: torch.Tensor
    attr_logits: torch.Tensor
    map_hw: tuple[int, int]
