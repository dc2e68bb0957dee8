"""Trained detector directories (detector.json + model.safetensors) and how training starts from a
checkpoint: released VG layout, another class list, a backbone-only file."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import numpy as np
import pytest
import torch

from extraction import Detector
from extraction.config import PRESETS, SMALL_PRESET
from extraction.preprocess import batch_images, resize_image
from extraction.rcnn import VGFasterRCNN, init_random_weights
from extraction.weights import (
    ANCHORS_KEY,
    DETECTOR_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    init_from_checkpoint,
    read_detector_dir,
    save_detector_dir,
)

CONFIG = dataclasses.replace(PRESETS[SMALL_PRESET], min_size=96, max_size=128, post_nms_topk=20)
CLASSES = ["cat", "dog", "tree"]
ATTRIBUTES = ["red", "small", "wooden", "tall"]
CLASS_HEADS = ("cls_score", "bbox_pred", "cls_embedding")
PREDICTOR = "roi_heads.box_predictor."


def build(config=CONFIG, seed: int = 0) -> VGFasterRCNN:
    model = VGFasterRCNN(config)
    init_random_weights(model, seed)
    return model.eval()


def network_input(image: np.ndarray, config=CONFIG) -> torch.Tensor:
    resized = resize_image(image, config.min_size, config.max_size)
    return batch_images([resized], config.pixel_mean, config.pixel_std, torch.device("cpu"))[0][0]


def outputs(model: VGFasterRCNN, image: torch.Tensor) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        return vars(model([image])[0])


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A c4-small detector with its own weights (seed 7) saved as a detector directory."""
    torch.set_num_threads(2)
    model = build(seed=7)
    directory = tmp_path_factory.mktemp("run") / "best"
    save_detector_dir(model, CONFIG, SMALL_PRESET, CLASSES, ATTRIBUTES, directory)
    return model, directory


def test_directory_builds_the_saved_detector_with_names(saved, make_image):
    model, directory = saved
    assert (directory / DETECTOR_FILE).is_file() and (directory / WEIGHTS_FILE).is_file()
    meta = read_detector_dir(directory)
    assert meta["classes"] == CLASSES and meta["attributes"] == ATTRIBUTES and meta["preset"] == SMALL_PRESET
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no random-weights warning
        # `preset` names only where the settings started: the directory's own architecture is used
        det = Detector.build(preset="vg-r101-c4", weights=directory)
    assert det.config == CONFIG and det.preset == SMALL_PRESET
    assert det.classes == CLASSES and det.attributes == ATTRIBUTES
    prov = det.provenance()
    assert prov["classes"] == CLASSES and prov["attributes"] == ATTRIBUTES
    assert prov["preset"] == SMALL_PRESET and prov["config"]["num_classes"] == 3
    image = network_input(make_image(1, 90, 120))
    ours, theirs = outputs(det.model, image), outputs(model, image)
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-6, msg=key)
    records = det.detect([make_image(1, 90, 120)], ids=["x"])
    assert records[0].img_id == "x" and records[0].num_boxes >= 1


def test_directory_refuses_architecture_overrides_but_takes_test_settings(saved):
    _, directory = saved
    with pytest.raises(CheckpointError, match="num_classes"):
        Detector.build(weights=directory, num_classes=5)
    with pytest.raises(CheckpointError, match="res2_channels"):
        Detector.build(weights=directory, res2_channels=64)
    det = Detector.build(weights=directory, num_classes=3, post_nms_topk=7, max_boxes=5, min_boxes=1)
    assert det.config == dataclasses.replace(CONFIG, post_nms_topk=7)
    assert det.selection.max_boxes == 5


def test_save_refuses_names_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="2 class names"):
        save_detector_dir(build(), CONFIG, SMALL_PRESET, CLASSES[:2], ATTRIBUTES, tmp_path / "d")


def test_broken_directories_are_named(saved, tmp_path):
    _, directory = saved
    (tmp_path / DETECTOR_FILE).write_text('{"format": "something-else"}')
    with pytest.raises(CheckpointError, match="not an xmodal detector"):
        read_detector_dir(tmp_path)
    (tmp_path / DETECTOR_FILE).write_text((directory / DETECTOR_FILE).read_text())
    with pytest.raises(CheckpointError, match=f"{WEIGHTS_FILE} is missing"):
        read_detector_dir(tmp_path)


# ---- starting a training run from a checkpoint


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A checkpoint in the released VG layout (detectron2 .pkl, {"model": {name: float32 array}}, pickle
    protocol 2, with the anchor buffer) for a c4-small network with 5 classes and 6 attributes."""
    config = dataclasses.replace(CONFIG, num_classes=5, num_attributes=6)
    source = build(config, seed=3)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():  # FrozenBN statistics unlike a fresh init's, so a missed refold would show
        for name, buf in source.named_buffers():
            if name.endswith(("norm.running_mean", "norm.bias")):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    source.load_state_dict(source.state_dict())  # refolds its own convolutions
    arrays = {k: v.numpy().copy() for k, v in source.state_dict().items()}
    anchors = source.proposal_generator.anchor_generator.cell_anchors.numpy()
    path = tmp_path_factory.mktemp("released") / "faster_rcnn_from_caffe_attr.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": {**arrays, ANCHORS_KEY: anchors}, "__author__": "test"}, f, protocol=2)
    return path, arrays, source


def test_released_checkpoint_starts_a_run_with_a_new_class_list(released, make_image):
    path, arrays, source = released
    model = build(seed=9)
    fresh = snapshot(model)
    report = init_from_checkpoint(model, path, classes=CLASSES, attributes=ATTRIBUTES)
    state = model.state_dict()
    rebuilt = {line.split(" ")[0] for line in report.rebuilt}
    assert rebuilt == {PREDICTOR + h for h in (*CLASS_HEADS, "attr_score")}
    assert any("class list of 5 vs 3" in line for line in report.rebuilt)
    assert any("attribute list of 6 vs 4" in line for line in report.rebuilt)
    assert report.unexpected == []
    assert [k for k in report.missing if not k.startswith(tuple(rebuilt))] == []
    for name, value in state.items():
        if any(name.startswith(h + ".") for h in rebuilt):
            assert torch.equal(value, fresh[name]), name  # left at the fresh init
        else:
            assert torch.equal(value, torch.from_numpy(arrays[name])), name
    assert report.loaded == len(state) - 2 * len(rebuilt) + 1  # cls_embedding has no bias
    assert not torch.equal(state[PREDICTOR + "fc_attr.weight"], fresh[PREDICTOR + "fc_attr.weight"])
    # the folded convolutions follow the loaded weights: the trunk and RPN compute the checkpoint's network
    image = network_input(make_image(2, 100, 128))
    with torch.inference_mode():
        features = model.backbone(image[None])
        torch.testing.assert_close(features, source.backbone(image[None]), rtol=0, atol=1e-6)
        ours = model.proposal_generator(features, tuple(image.shape[-2:]))
        theirs = source.proposal_generator(features, tuple(image.shape[-2:]))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_same_count_but_other_class_names_rebuilds_the_class_heads(saved):
    _, directory = saved
    renamed = ["bird", "dog", "tree"]
    model = build(seed=10)
    fresh = snapshot(model)
    report = init_from_checkpoint(model, directory, classes=renamed, attributes=ATTRIBUTES)
    assert [line.split(" ")[0] for line in report.rebuilt] == [PREDICTOR + h for h in CLASS_HEADS]
    assert all("class names differ" in line for line in report.rebuilt)
    assert report.unexpected == []
    assert [k for k in report.missing if not k.startswith(PREDICTOR)] == []
    saved_state = saved[0].state_dict()
    for name, value in model.state_dict().items():
        expected = (
            fresh[name] if name.startswith(tuple(PREDICTOR + h for h in CLASS_HEADS)) else saved_state[name]
        )
        assert torch.equal(value, expected), name
    # other attribute names: only the attribute scores start afresh
    report = init_from_checkpoint(build(seed=10), directory, classes=CLASSES, attributes=["a", "b", "c", "d"])
    assert [line.split(" ")[0] for line in report.rebuilt] == [PREDICTOR + "attr_score"]
    # the same names (or none given): everything loads
    for classes in (CLASSES, None):
        report = init_from_checkpoint(build(seed=10), directory, classes=classes, attributes=ATTRIBUTES)
        assert report.rebuilt == [] and report.missing == [] and report.loaded == len(saved_state)


def test_backbone_only_checkpoint_loads_the_trunk_and_lists_the_rest(released, tmp_path):
    _, arrays, _ = released
    trunk = {k: torch.from_numpy(v) for k, v in arrays.items() if k.startswith("backbone.")}
    path = tmp_path / "r50_like.pth"
    torch.save({**trunk, "backbone.fc.weight": torch.zeros(2, 2)}, path)
    model = build(seed=11)
    fresh = snapshot(model)
    report = init_from_checkpoint(model, path, classes=CLASSES, attributes=ATTRIBUTES)
    assert report.loaded == len(trunk) and report.rebuilt == []
    assert report.unexpected == ["backbone.fc.weight"]
    assert report.missing == [k for k in fresh if not k.startswith("backbone.")]
    for name, value in model.state_dict().items():
        assert torch.equal(value, trunk[name] if name in trunk else fresh[name]), name


def test_rebuilt_heads_are_not_reported_missing(released):
    """InitReport.missing holds the *other* tensors the checkpoint lacks: a rebuilt head is in
    `rebuilt`, not also in `missing` (nor in the "lacks N tensors" warning)."""
    path, _, _ = released
    report = init_from_checkpoint(build(seed=12), path, classes=CLASSES, attributes=ATTRIBUTES)
    assert len(report.rebuilt) == 4
    assert report.missing == []
