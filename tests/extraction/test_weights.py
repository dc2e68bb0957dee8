"""Checkpoints in every format load; bad names/shapes are reported by name; pickles cannot run code."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from extraction.config import DetectorConfig
from extraction.rcnn import VGFasterRCNN
from extraction.weights import (
    ANCHORS_KEY,
    CheckpointError,
    convert_detector_checkpoint,
    load_detector_weights,
    read_checkpoint,
)

SMALL = DetectorConfig(blocks_per_stage=(1, 1, 1), num_classes=10, num_attributes=5)


def fake_arrays(model: torch.nn.Module, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(tuple(v.shape), dtype=np.float32) for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def arrays() -> dict[str, np.ndarray]:
    with torch.device("meta"):
        return fake_arrays(VGFasterRCNN(SMALL))


def assert_loaded(model: torch.nn.Module, arrays: dict[str, np.ndarray]) -> None:
    state = model.state_dict()
    assert set(state) == set(arrays)
    for name, value in arrays.items():
        assert torch.equal(state[name], torch.from_numpy(value)), name


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_restricted_unpickler_reads_arrays_of_every_protocol(tmp_path, protocol):
    rng = np.random.default_rng(protocol)
    arrays = {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": np.arange(5), "c": np.zeros((0, 2))}
    path = tmp_path / "x.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": arrays, "__author__": "test"}, f, protocol=protocol)
    state = read_checkpoint(path)
    assert set(state) == set(arrays)
    for k, v in arrays.items():
        np.testing.assert_array_equal(state[k].numpy(), v)
        assert state[k].numpy().dtype == v.dtype


def test_detectron2_pickle_loads(tmp_path, arrays):
    anchors = VGFasterRCNN(SMALL).proposal_generator.anchor_generator.cell_anchors.numpy()
    payload = {"model": {**arrays, ANCHORS_KEY: anchors}, "__author__": "test", "matching_heuristics": True}
    path = tmp_path / "faster_rcnn_from_caffe_attr.pkl"
    with open(path, "wb") as f:
        pickle.dump(payload, f, protocol=4)
    model = VGFasterRCNN(SMALL)
    report = load_detector_weights(model, path)
    assert report.ok and report.ignored == [ANCHORS_KEY]
    assert_loaded(model, arrays)


def test_huggingface_bin_loads_ignoring_num_batches_tracked(tmp_path, arrays):
    state = {k: torch.from_numpy(v) for k, v in arrays.items()}
    tracked = {
        k.replace("running_mean", "num_batches_tracked"): torch.tensor(0)
        for k in arrays
        if "running_mean" in k
    }
    path = tmp_path / "pytorch_model.bin"
    torch.save({**state, **tracked}, path)
    model = VGFasterRCNN(SMALL)
    report = load_detector_weights(model, path)
    assert report.ok and sorted(report.ignored) == sorted(tracked)
    assert_loaded(model, arrays)


def test_safetensors_loads(tmp_path, arrays):
    path = tmp_path / "detector.safetensors"
    save_file({k: torch.from_numpy(v) for k, v in arrays.items()}, str(path))
    model = VGFasterRCNN(SMALL)
    assert load_detector_weights(model, path).ok
    assert_loaded(model, arrays)


def test_wrong_missing_and_mismatched_names_are_reported(tmp_path, arrays):
    bad = dict(arrays)
    del bad["roi_heads.box_predictor.cls_score.bias"]
    bad["roi_heads.box_predictor.extra.weight"] = np.zeros(3, np.float32)
    bad["proposal_generator.rpn_head.conv.bias"] = np.zeros(7, np.float32)
    path = tmp_path / "bad.safetensors"
    save_file({k: torch.from_numpy(v) for k, v in bad.items()}, str(path))
    model = VGFasterRCNN(SMALL)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_detector_weights(model, path)
    message = str(err.value)
    assert "missing" in message and "roi_heads.box_predictor.cls_score.bias" in message
    assert "unexpected" in message and "roi_heads.box_predictor.extra.weight" in message
    assert "proposal_generator.rpn_head.conv.bias: checkpoint (7,) vs model (512,)" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused: nothing loaded

    report = load_detector_weights(model, path, strict=False)
    assert report.missing == ["roi_heads.box_predictor.cls_score.bias"]
    assert report.unexpected == ["roi_heads.box_predictor.extra.weight"]
    assert len(report.mismatched) == 1
    loaded = model.state_dict()
    assert torch.equal(
        loaded["backbone.stem.conv1.weight"], torch.from_numpy(arrays["backbone.stem.conv1.weight"])
    )
    assert torch.equal(
        loaded["proposal_generator.rpn_head.conv.bias"], before["proposal_generator.rpn_head.conv.bias"]
    )


def test_anchors_that_differ_from_the_preset_are_reported(tmp_path, arrays):
    path = tmp_path / "a.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": {**arrays, ANCHORS_KEY: np.ones((12, 4), np.float32)}}, f)
    with pytest.raises(CheckpointError, match="anchors differ"):
        load_detector_weights(VGFasterRCNN(SMALL), path)


class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_with_code_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": {"backbone.stem.conv1.weight": _Evil(str(marker))}}, f)
    with pytest.raises(CheckpointError, match="refusing to load .*system"):
        load_detector_weights(VGFasterRCNN(SMALL), path)
    assert not marker.exists()


def test_non_array_entries_and_unknown_suffix(tmp_path):
    path = tmp_path / "s.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": {"backbone.stem.conv1.weight": "text"}}, f)
    with pytest.raises(CheckpointError, match="backbone.stem.conv1.weight.*not an array"):
        load_detector_weights(VGFasterRCNN(SMALL), path)
    other = tmp_path / "w.h5"
    other.write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unknown suffix"):
        load_detector_weights(VGFasterRCNN(SMALL), other)


@pytest.mark.slow
def test_convert_full_size_pickle_through_the_cli(tmp_path):
    from pipelines.cli import main

    with torch.device("meta"):
        full = VGFasterRCNN(DetectorConfig())
    arrays = {k: np.full(tuple(v.shape), i, np.float32) for i, (k, v) in enumerate(full.state_dict().items())}
    src = tmp_path / "faster_rcnn_from_caffe_attr.pkl"
    with open(src, "wb") as f:
        pickle.dump({"model": arrays}, f, protocol=4)
    dst = tmp_path / "out" / "detector.safetensors"
    assert main(["convert", "detector", str(src), str(dst)]) == 0
    out = load_file(str(dst))
    assert set(out) == set(arrays)
    for i, k in enumerate(arrays):
        assert tuple(out[k].shape) == arrays[k].shape and float(out[k].flatten()[0]) == i


def test_convert_refuses_an_incomplete_checkpoint_unless_not_strict(tmp_path):
    src = tmp_path / "part.safetensors"
    save_file({"backbone.stem.conv1.weight": torch.ones(64, 3, 7, 7), "junk": torch.ones(2)}, str(src))
    dst = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match="534 missing") as err:
        convert_detector_checkpoint(src, dst)
    assert "roi_heads.box_predictor.attr_score.bias" in str(err.value) and "junk" in str(err.value)
    assert err.value.report.summary() == {"missing": 534, "unexpected": 1, "mismatched": 0, "ignored": 0}
    assert not dst.exists()
    report = convert_detector_checkpoint(src, dst, strict=False)
    assert len(report.missing) == 534 and report.unexpected == ["junk"]
    assert list(load_file(str(dst))) == ["backbone.stem.conv1.weight"]


def test_convert_checks_against_the_named_preset(tmp_path, arrays, monkeypatch):
    from safetensors import safe_open

    from extraction.config import PRESETS

    monkeypatch.setitem(PRESETS, "small-test", SMALL)
    src = tmp_path / "small.safetensors"
    save_file({k: torch.from_numpy(v) for k, v in arrays.items()}, str(src))
    dst = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match="mismatched"):
        convert_detector_checkpoint(src, dst)  # the default preset is the full R101 with 1600 classes
    assert convert_detector_checkpoint(src, dst, preset="small-test").ok
    assert set(load_file(str(dst))) == set(arrays)
    with safe_open(str(dst), "pt") as f:
        assert f.metadata()["preset"] == "small-test"
    with pytest.raises(ValueError, match="unknown detector preset 'r50'"):
        convert_detector_checkpoint(src, dst, preset="r50")
