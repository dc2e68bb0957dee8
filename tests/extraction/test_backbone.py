"""The caffe stem and feature sizes, and FrozenBatchNorm folded into the convolutions: the same numbers as
detectron2's conv -> F.batch_norm arithmetic, refolded on every load, detectron2's names kept."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from extraction.backbone import BottleneckBlock, Conv2d, ResNetC4


def res4_size(n: int) -> int:
    """conv 7x7/2 p3 -> caffe pool k3 s2 p0 ceil -> two stride-2 1x1 convs."""
    n = (n - 1) // 2 + 1
    n = math.ceil((n - 3) / 2) + 1
    for _ in range(2):
        n = (n - 1) // 2 + 1
    return n


def d2_conv(conv: Conv2d, x: torch.Tensor) -> torch.Tensor:
    """detectron2: the bias-free convolution, then FrozenBatchNorm2d's inference path (F.batch_norm)."""
    y = F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation)
    n = conv.norm
    return F.batch_norm(y, n.running_mean, n.running_var, n.weight, n.bias, False, 0.0, n.eps)


def d2_block(block: BottleneckBlock, x: torch.Tensor) -> torch.Tensor:
    out = F.relu_(d2_conv(block.conv1, x))
    out = F.relu_(d2_conv(block.conv2, out))
    out = d2_conv(block.conv3, out)
    out += x if block.shortcut is None else d2_conv(block.shortcut, x)
    return F.relu_(out)


def randomise_norms(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial frozen statistics (the defaults fold to the identity)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, value in module.state_dict().items():
        if ".norm." in f".{name}":
            state[name] = torch.rand(value.shape, generator=g) + 0.5
            if name.endswith(("bias", "running_mean")):
                state[name] -= 1.0
        else:
            state[name] = torch.randn(value.shape, generator=g) * 0.1
    module.load_state_dict(state)


def test_caffe_stem_pool_and_feature_sizes(small_detector):
    with torch.inference_mode():
        stem = small_detector.model.backbone.stem(torch.zeros(1, 3, 600, 800))
        assert stem.shape[-2:] == (150, 200)  # 300x400 -> ceil((300-3)/2)+1, padding 0
        narrow = ResNetC4((1, 1, 1), stem_channels=8, res2_channels=16, bottleneck_channels=4)
        for h, w in [(600, 800), (600, 1000), (333, 1000), (65, 97)]:
            assert tuple(narrow(torch.zeros(1, 3, h, w)).shape) == (1, 64, res4_size(h), res4_size(w))
    assert [(res4_size(h), res4_size(w)) for h, w in [(600, 800), (600, 1000), (333, 1000)]] == [
        (38, 50),
        (38, 63),
        (21, 63),
    ]


@pytest.mark.parametrize(("in_ch", "out_ch", "stride", "dilation"), [(16, 32, 2, 1), (32, 32, 1, 2)])
def test_folded_block_equals_detectron2_arithmetic(in_ch, out_ch, stride, dilation):
    block = BottleneckBlock(in_ch, out_ch, 8, stride=stride, dilation=dilation)
    randomise_norms(block, in_ch + dilation)
    x = torch.randn(3, in_ch, 14, 15, generator=torch.Generator().manual_seed(1)).relu_()
    with torch.inference_mode():
        torch.testing.assert_close(block(x), d2_block(block, x.clone()), rtol=1e-5, atol=1e-5)


def test_state_dict_keeps_detectron2_names_and_every_load_refolds():
    conv = Conv2d(4, 6, 3)
    assert list(conv.state_dict()) == [
        "weight",
        "norm.weight",
        "norm.bias",
        "norm.running_mean",
        "norm.running_var",
    ]
    x = torch.randn(2, 4, 9, 9, generator=torch.Generator().manual_seed(0))
    for seed in (1, 2):  # a second load replaces the first fold
        randomise_norms(conv, seed)
        with torch.inference_mode():
            torch.testing.assert_close(conv(x), d2_conv(conv, x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        conv.weight.mul_(2)  # an in-place edit needs an explicit fold
    conv.fold()
    with torch.inference_mode():
        torch.testing.assert_close(conv(x), d2_conv(conv, x), rtol=1e-5, atol=1e-5)
