"""float32 means IEEE float32 on CUDA in extraction: TF32 is switched off while the detector runs, put
back afterwards, and recorded in the provenance."""

from __future__ import annotations

import pytest
import torch

from extraction.precision import float32_precision, tf32_flags


@pytest.fixture
def restore_flags():
    before = tf32_flags()
    yield
    torch.backends.cuda.matmul.allow_tf32 = before["matmul"]
    torch.backends.cudnn.allow_tf32 = before["cudnn"]


def set_flags(value: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = value
    torch.backends.cudnn.allow_tf32 = value


@pytest.mark.parametrize("outside", [True, False])
@pytest.mark.parametrize("inside", [True, False])
def test_the_block_sees_its_setting_and_the_old_one_comes_back(restore_flags, outside, inside):
    set_flags(outside)
    with float32_precision(inside):
        assert tf32_flags() == {"matmul": inside, "cudnn": inside}
    assert tf32_flags() == {"matmul": outside, "cudnn": outside}


def test_the_old_setting_comes_back_after_an_error(restore_flags):
    set_flags(True)
    with pytest.raises(RuntimeError), float32_precision(False):
        raise RuntimeError("boom")
    assert tf32_flags() == {"matmul": True, "cudnn": True}


def _spy_on_network(detector, monkeypatch) -> list[dict[str, bool]]:
    seen: list[dict[str, bool]] = []
    forward = detector.model.forward

    def spying(*args, **kwargs):
        seen.append(tf32_flags())
        return forward(*args, **kwargs)

    monkeypatch.setattr(detector.model, "forward", spying)
    return seen


def test_detect_runs_the_network_without_tf32(small_detector, make_image, restore_flags, monkeypatch):
    """PyTorch leaves cuDNN convolutions in TF32 by default; a caller may have switched matmuls on too."""
    seen = _spy_on_network(small_detector, monkeypatch)
    set_flags(True)
    small_detector.detect([make_image(0, 80, 90)])
    assert seen == [{"matmul": False, "cudnn": False}]
    assert tf32_flags() == {"matmul": True, "cudnn": True}
    assert small_detector.provenance()["tf32"] is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_detect_on_cuda_is_ieee_float32(small_detector, make_image, reselect, restore_flags, monkeypatch):
    """On the GPU the regions match the CPU run of the same network far closer than TF32's ~1e-3."""
    image = make_image(1, 80, 90)
    small_detector.model.cuda()
    try:
        seen = _spy_on_network(small_detector, monkeypatch)
        set_flags(True)
        (on_gpu,) = small_detector.detect([image])
        assert seen == [{"matmul": False, "cudnn": False}]
        assert small_detector.provenance()["tf32"] is False
    finally:
        small_detector.model.cpu()
    (on_cpu,) = small_detector.detect([image])
    assert on_gpu.boxes.shape == on_cpu.boxes.shape
    scale = float(abs(on_cpu.features).max()) + 1e-6
    assert float(abs(on_gpu.features.astype("float64") - on_cpu.features).max()) / scale < 1e-4


@pytest.mark.parametrize("outside", [(False, True), (True, False)])
def test_deterministic_cudnn_holds_inside_and_puts_back_what_was_set(outside):
    from extraction.precision import deterministic_cudnn

    cudnn = torch.backends.cudnn
    before = cudnn.deterministic, cudnn.benchmark
    try:
        cudnn.deterministic, cudnn.benchmark = outside
        with deterministic_cudnn():
            assert (cudnn.deterministic, cudnn.benchmark) == (True, False)
        assert (cudnn.deterministic, cudnn.benchmark) == outside
        with pytest.raises(RuntimeError), deterministic_cudnn():
            raise RuntimeError("a failed detection")
        assert (cudnn.deterministic, cudnn.benchmark) == outside
    finally:
        cudnn.deterministic, cudnn.benchmark = before
