"""ResNet C4 trunk (stem + res2..res4) with FrozenBatchNorm, caffe stem pool and stride in the 1x1 conv.

Each FrozenBatchNorm is folded into its convolution's weights and bias when weights are loaded (the
checkpoint keeps detectron2's `conv.weight` / `conv.norm.*` names), so a block is conv -> relu_ three
times plus one in-place residual add; convolutions run channels-last, oneDNN's native CPU layout, except
in float32 on CUDA (`conv_memory_format`). On a padded canvas (the batched forward) a `CanvasMask` zeroes
every activation beyond each image, so each convolution reads there the zeros its padding would give.
In training, a convolution whose weight takes gradients scales it by the frozen norm inside autograd
(the same arithmetic), and the folded copy is rebuilt after the optimizer has changed the weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class FrozenBatchNorm2d(nn.Module):
    """BatchNorm with fixed statistics and affine parameters, all stored as buffers (detectron2 layout).

    It has no forward: `Conv2d` folds it into the convolution."""

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features) - eps)

    def scale_and_shift(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, t) with norm(x) = x * s + t, computed in float64 and rounded once."""
        scale = self.weight.double() * (self.running_var.double() + self.eps).rsqrt()
        shift = self.bias.double() - self.running_mean.double() * scale
        return scale, shift


class Conv2d(nn.Conv2d):
    """A bias-free convolution followed by its FrozenBatchNorm (`<name>.weight`, `<name>.norm.*`), run as
    one convolution with the norm folded in. The folded copy is rebuilt whenever a state dict is loaded;
    call `fold()` after changing the weights in place."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, stride: int = 1, dilation: int = 1):
        padding = dilation * (kernel_size - 1) // 2
        super().__init__(
            in_ch, out_ch, kernel_size, stride=stride, padding=padding, dilation=dilation, bias=False
        )
        self.norm = FrozenBatchNorm2d(out_ch)
        self.register_buffer("folded_weight", torch.empty_like(self.weight), persistent=False)
        self.register_buffer("folded_bias", torch.empty(out_ch), persistent=False)
        self.register_load_state_dict_post_hook(_refold)
        self._folded_version = -1
        self.memory_format = torch.channels_last  # of the folded weight; set_memory_format changes it
        self.fold()

    @torch.no_grad()
    def fold(self) -> None:
        scale, shift = self.norm.scale_and_shift()
        weight = (self.weight.double() * scale.view(-1, 1, 1, 1)).to(self.weight.dtype)
        self.folded_weight = weight.contiguous(memory_format=self.memory_format)
        self.folded_bias = shift.to(self.weight.dtype)
        self._folded_version = _version(self.weight)

    def forward(self, x: torch.Tensor, dilation: int | None = None) -> torch.Tensor:
        """`dilation`, when given, replaces the layer's own (with the padding that keeps the size)."""
        padding, dilations = self.padding, self.dilation
        if dilation is not None:
            dilations = (dilation, dilation)
            padding = tuple(dilation * (k - 1) // 2 for k in self.kernel_size)
        if self.weight.requires_grad and torch.is_grad_enabled():
            scale, shift = self.norm.scale_and_shift()
            weight = self.weight * scale.to(self.weight.dtype).view(-1, 1, 1, 1)
            bias = shift.to(self.weight.dtype)
            return F.conv2d(x, weight, bias, self.stride, padding, dilations, self.groups)
        if self._folded_version != _version(self.weight):  # an optimizer step changed the weight in place
            self.fold()
        return F.conv2d(x, self.folded_weight, self.folded_bias, self.stride, padding, dilations, self.groups)


def _version(t: torch.Tensor) -> int:
    """The in-place version counter (tensors made under inference mode have none, and never change)."""
    return -2 if t.is_inference() else t._version


def _refold(module: Conv2d, incompatible_keys) -> None:
    module.fold()


def conv_memory_format(device: torch.device, dtype: str) -> torch.memory_format:
    """The convolutions' layout: channels-last (oneDNN's native CPU layout, and what tensor cores read in
    bfloat16/float16), but NCHW for float32 on CUDA. There cuDNN runs res5's dilated 3x3 convolutions on
    channels-last tensors with a grouped direct kernel: res5 over 300 RoIs took 1,424 ms channels-last and
    55 ms NCHW on an H200 (TF32 off), with bitwise-equal outputs (SPEC section 10, BENCHMARKS.md)."""
    if torch.device(device).type == "cuda" and dtype == "float32":
        return torch.contiguous_format
    return torch.channels_last


def set_memory_format(model: nn.Module, memory_format: torch.memory_format) -> None:
    """Lay out every folded convolution weight, and the inputs the trunk and RoI head convert, in
    `memory_format` (a weight and its input in different layouts run the slowest kernels)."""
    for module in model.modules():
        if "memory_format" in vars(module):
            module.memory_format = memory_format
            if isinstance(module, Conv2d):
                module.fold()


def _strided(extent: int, stride: int) -> int:
    """Output extent of a convolution whose padding keeps the sampled positions aligned at 0 (the stem's
    7x7/2 pad 3, the 1x1 stride-2 convolutions): positions i with i * stride < extent."""
    return (extent - 1) // stride + 1 if extent > 0 else 0


def _pooled(extent: int) -> int:
    """Output extent of the stem's max-pool (k3 s2, no padding, ceil mode), as torch computes it."""
    if extent <= 0:
        return 0
    out = -(-(extent - 3) // 2) + 1
    return out - 1 if (out - 1) * 2 >= extent else out


def trunk_extents(h: int, w: int) -> list[tuple[int, int]]:
    """The (h, w) of an (h, w) input at each resolution of the trunk: stem conv, pool, res3, res4."""
    sizes = [(_strided(h, 2), _strided(w, 2))]
    sizes.append((_pooled(sizes[-1][0]), _pooled(sizes[-1][1])))
    for _ in range(2):  # res3 and res4 each halve on their first block
        sizes.append((_strided(sizes[-1][0], 2), _strided(sizes[-1][1], 2)))
    return sizes


class CanvasMask:
    """Images of a padded canvas batch, each at (h, w) in its slot's top-left corner (a blank slot has
    (0, 0)); called on an activation, zeroes it beyond each image's extent at that resolution.

    Each resolution of the trunk has its own canvas size, so a map's (H, W) says which extents apply.
    Activations masked are ReLU outputs (finite, >= 0): multiplying by 1 leaves them bit for bit."""

    def __init__(self, sizes: list[tuple[int, int]], canvas_hw: tuple[int, int]):
        levels = [[(h, w), *trunk_extents(h, w)] for h, w in sizes]
        self.extents = {}
        for level, canvas in enumerate([tuple(canvas_hw), *trunk_extents(*canvas_hw)]):
            self.extents[canvas] = [ext[level] for ext in levels]
        self._masks: dict[tuple, torch.Tensor] = {}
        self._uploaded: dict[torch.device, dict[tuple, torch.Tensor]] = {}

    def subsample(self, hw: tuple[int, int], step: int) -> None:
        """Also mask the map of canvas size `hw` taken every `step` rows and columns (grid stride 32)."""
        self.extents[tuple(-(-n // step) for n in hw)] = [
            (-(-h // step), -(-w // step)) for h, w in self.extents[tuple(hw)]
        ]
        self._uploaded.clear()

    def at(self, hw: tuple[int, int]) -> list[tuple[int, int]]:
        """Each slot's extent on a map of canvas size `hw`."""
        return self.extents[tuple(hw)]

    def on(self, hw: tuple[int, int], device: torch.device) -> torch.Tensor:
        """`at` as a (B, 2) int64 tensor on `device`; every level's extents go up in one copy."""
        if device not in self._uploaded:
            levels = list(self.extents)
            table = upload(torch.tensor([self.extents[k] for k in levels], dtype=torch.int64), device)
            self._uploaded[device] = dict(zip(levels, table.unbind(0), strict=True))
        return self._uploaded[device][tuple(hw)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        hw = tuple(x.shape[-2:])
        key = (hw, x.dtype, x.device)
        if key not in self._masks:
            # built on the device from the extents: no op per slot
            extents = self.on(hw, x.device)
            ys = torch.arange(hw[0], device=x.device)[None, :, None] < extents[:, :1, None]
            xs = torch.arange(hw[1], device=x.device)[None, None, :] < extents[:, 1:, None]
            self._masks[key] = (ys & xs)[:, None].to(x.dtype)
        return x.mul_(self._masks[key])


def upload(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU it goes through pinned memory on a copy stream of its own: the
    host does not wait (a pageable copy waits for the device's queue, a host sync) and the copy overlaps
    the kernels already queued (the previous batch's); the compute stream waits for it before use."""
    if device.type != "cuda":
        return x.to(device)
    pinned = x.pin_memory()
    copy = _COPY_STREAMS.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(copy):
        out = pinned.to(device, non_blocking=True)
    compute = torch.cuda.current_stream(device)
    compute.wait_stream(copy)
    out.record_stream(compute)  # its memory is not reused until the compute stream is done with it
    return out


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _unmasked(x: torch.Tensor) -> torch.Tensor:
    return x


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

    def forward(
        self,
        x: torch.Tensor,
        dilation: int | None = None,
        mask: Callable[[torch.Tensor], torch.Tensor] = _unmasked,
    ) -> torch.Tensor:
        """`dilation`, when given, replaces the 3x3 convolution's own; `mask` (a CanvasMask) zeroes each
        activation beyond the images of a padded canvas."""
        out = mask(F.relu_(self.conv1(x)))
        out = mask(F.relu_(self.conv2(out) if dilation is None else self.conv2(out, dilation)))
        out = self.conv3(out)
        out += x if self.shortcut is None else self.shortcut(x)
        return mask(F.relu_(out))


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

    def forward(
        self, x: torch.Tensor, mask: Callable[[torch.Tensor], torch.Tensor] = _unmasked
    ) -> torch.Tensor:
        # on a canvas the pool's last window may take in masked zeros: ReLU outputs are >= 0, so the
        # maximum is the one over the image's own positions, as without the canvas
        x = mask(F.relu_(self.conv1(x)))
        return mask(F.max_pool2d(x, kernel_size=3, stride=2, padding=0, ceil_mode=True))


class ResNetC4(nn.Module):
    """Stem and res2..res4: (N, 3, H, W) -> (N, 4 * res2_channels, H/16, W/16) in `memory_format`."""

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
        self.memory_format = torch.channels_last

    def forward(
        self, x: torch.Tensor, mask: Callable[[torch.Tensor], torch.Tensor] = _unmasked
    ) -> torch.Tensor:
        """`mask` (a CanvasMask) when `x` is a padded canvas batch."""
        x = self.stem(x.contiguous(memory_format=self.memory_format), mask)
        for stage in (self.res2, self.res3, self.res4):
            for block in stage:
                x = block(x, mask=mask)
        return x

    def freeze(self, freeze_at: int) -> None:
        """detectron2's FREEZE_AT: 1 freezes the stem, 2 the stem and res2, ... (0 freezes nothing)."""
        stages = [self.stem, self.res2, self.res3, self.res4][:freeze_at]
        for stage in stages:
            for p in stage.parameters():
                p.requires_grad_(False)
