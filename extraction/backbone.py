"""ResNet-101 C4 trunk (stem + res2..res4) with FrozenBatchNorm, caffe stem pool and stride in the 1x1 conv.

Batches are zero-padded to a common size. Where a 3x3 convolution or the stem pool would read the
padding, it is zeroed again, so each image's features equal those it gets alone (detectron2 lets the
padding leak into the borders, which makes features depend on the batch).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

Sizes = list[tuple[int, int]]


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm with fixed statistics and affine parameters, all stored as buffers (detectron2 layout)."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features) - eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * (self.running_var + self.eps).rsqrt()
        bias = self.bias - self.running_mean * scale
        return x * scale.view(1, -1, 1, 1).to(x.dtype) + bias.view(1, -1, 1, 1).to(x.dtype)


class Conv2d(nn.Conv2d):
    """A bias-free convolution followed by its FrozenBatchNorm (`<name>.weight`, `<name>.norm.*`)."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1, dilation: int = 1):
        padding = dilation * (kernel_size - 1) // 2
        super().__init__(
            in_ch, out_ch, kernel_size, stride=stride, padding=padding, dilation=dilation, bias=False
        )
        self.norm = FrozenBatchNorm2d(out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))

    def out_size(self, size: int) -> int:
        k, s, p, d = self.kernel_size[0], self.stride[0], self.padding[0], self.dilation[0]
        return (size + 2 * p - d * (k - 1) - 1) // s + 1


def zero_padding(x: torch.Tensor, sizes: Sizes | None) -> torch.Tensor:
    """Zero everything outside each image's valid (h, w) corner; a no-op when nothing is padded."""
    if sizes is None:
        return x
    for i, (h, w) in enumerate(sizes):
        x[i, :, h:, :] = 0
        x[i, :, :h, w:] = 0
    return x


def _padded(sizes: Sizes, x: torch.Tensor) -> Sizes | None:
    """`sizes` if some image is smaller than the tensor, else None (no masking needed)."""
    full = (x.shape[-2], x.shape[-1])
    return None if all(s == full for s in sizes) else sizes


class BottleneckBlock(nn.Module):
    """1x1 -> 3x3 -> 1x1 residual block; the stride sits on conv1 (caffe's STRIDE_IN_1X1)."""

    def __init__(self, in_ch: int, out_ch: int, bottleneck_ch: int, stride: int = 1, dilation: int = 1):
        super().__init__()
        if in_ch != out_ch:
            self.shortcut = Conv2d(in_ch, out_ch, 1, stride=stride)
        else:
            self.shortcut = None
        self.conv1 = Conv2d(in_ch, bottleneck_ch, 1, stride=stride)
        self.conv2 = Conv2d(bottleneck_ch, bottleneck_ch, 3, dilation=dilation)
        self.conv3 = Conv2d(bottleneck_ch, out_ch, 1)

    def out_size(self, size: int) -> int:
        return self.conv1.out_size(size)

    def forward(self, x: torch.Tensor, sizes: Sizes | None = None) -> torch.Tensor:
        out = F.relu_(self.conv1(x))
        if sizes is not None:
            sizes = _padded([(self.out_size(h), self.out_size(w)) for h, w in sizes], out)
            zero_padding(out, sizes)
        out = F.relu_(self.conv2(out))
        out = self.conv3(out)
        out = out + (x if self.shortcut is None else self.shortcut(x))
        return F.relu_(out)


def make_stage(
    num_blocks: int, in_ch: int, out_ch: int, bottleneck_ch: int, first_stride: int, dilation: int = 1
) -> nn.Sequential:
    blocks = []
    for i in range(num_blocks):
        stride = first_stride if i == 0 else 1
        blocks.append(BottleneckBlock(in_ch, out_ch, bottleneck_ch, stride=stride, dilation=dilation))
        in_ch = out_ch
    return nn.Sequential(*blocks)


class BasicStem(nn.Module):
    """7x7/2 conv + FrozenBN + ReLU, then caffe's max-pool (k3 s2, no padding, ceil mode)."""

    def __init__(self, in_ch: int = 3, out_ch: int = 64):
        super().__init__()
        self.conv1 = Conv2d(in_ch, out_ch, 7, stride=2)

    def out_size(self, size: int) -> int:
        return math.ceil((self.conv1.out_size(size) - 3) / 2) + 1

    def forward(self, x: torch.Tensor, sizes: Sizes | None = None) -> torch.Tensor:
        x = F.relu_(self.conv1(x))
        if sizes is not None:
            # post-ReLU values are >= 0, so zeros in the padding never win the max
            zero_padding(x, _padded([(self.conv1.out_size(h), self.conv1.out_size(w)) for h, w in sizes], x))
        return F.max_pool2d(x, kernel_size=3, stride=2, padding=0, ceil_mode=True)


class ResNetC4(nn.Module):
    """Stem and res2..res4: (N, 3, H, W) -> (N, 4 * res2_channels, H/16, W/16)."""

    def __init__(
        self,
        blocks_per_stage: tuple[int, int, int] = (3, 4, 23),
        stem_channels: int = 64,
        res2_channels: int = 256,
        bottleneck_channels: int = 64,
    ):
        super().__init__()
        self.stem = BasicStem(out_ch=stem_channels)
        in_ch, out_ch, mid = stem_channels, res2_channels, bottleneck_channels
        for name, blocks, stride in zip(("res2", "res3", "res4"), blocks_per_stage, (1, 2, 2), strict=True):
            setattr(self, name, make_stage(blocks, in_ch, out_ch, mid, first_stride=stride))
            in_ch, out_ch, mid = out_ch, out_ch * 2, mid * 2
        self.out_channels = in_ch

    def output_sizes(self, sizes: Sizes) -> Sizes:
        """Each image's valid res4 size, as if it were run alone."""
        out = []
        for h, w in sizes:
            h, w = self.stem.out_size(h), self.stem.out_size(w)
            for stage in (self.res2, self.res3, self.res4):
                h, w = stage[0].out_size(h), stage[0].out_size(w)
            out.append((h, w))
        return out

    def forward(self, x: torch.Tensor, sizes: Sizes | None = None) -> torch.Tensor:
        """`sizes`: each image's (h, w) inside the zero-padded batch; None when nothing is padded."""
        if sizes is not None:
            sizes = _padded(sizes, x)
        x = self.stem(x, sizes)
        if sizes is not None:
            sizes = [(self.stem.out_size(h), self.stem.out_size(w)) for h, w in sizes]
        for stage in (self.res2, self.res3, self.res4):
            for block in stage:
                x = block(x, sizes)
                if sizes is not None:
                    sizes = [(block.out_size(h), block.out_size(w)) for h, w in sizes]
        if sizes is not None:
            zero_padding(x, _padded(sizes, x))
        return x
