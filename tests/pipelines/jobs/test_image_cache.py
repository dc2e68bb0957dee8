"""`evaluate --images` extracts as the run's training features were, or refuses naming the difference."""

from __future__ import annotations

import json

import pytest
import yaml

from extraction.config import SMALL_PRESET
from extraction.grid import GridConfig
from extraction.provenance import provenance, sha256
from extraction.weights import resolve_detector, weights_file
from pipelines.cli import main
from pipelines.jobs.extract.config import ExtractConfig
from pipelines.jobs.image_cache import config_for_run
from pipelines.jobs.image_inputs import InputError
from pipelines.tasks.finetune import RUN_FILE


def record(weights=None, max_boxes: int = 10, grid: str | None = None, **overrides) -> dict:
    """The provenance a store extracted with these settings carries (as a fine-tuning run records it)."""
    config, sel, preset, classes, attributes = resolve_detector(
        SMALL_PRESET, weights, "caffe", max_boxes, max_boxes, **overrides
    )
    info = {"path": "random", "sha256": None}
    if weights is not None:
        info = {"path": str(weights), "sha256": sha256(weights_file(weights))}
    if classes is not None:  # a detector directory's names, as the extraction records them
        info.update(classes=classes, attributes=attributes)
    parsed = GridConfig.parse(grid) if grid else None
    return json.loads(json.dumps(provenance(preset, config, sel, info, config.feature_dim, parsed)))


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "detector.safetensors"
    path.write_bytes(b"the trained detector")
    return path


def test_the_recorded_settings_are_used_when_none_are_given(weights):
    fitted = config_for_run(record(weights, max_boxes=10, min_size=160), ExtractConfig(), set(), "r")
    assert (fitted.preset, fitted.weights) == (SMALL_PRESET, str(weights))
    assert (fitted.min_boxes, fitted.max_boxes) == (10, 10)
    assert fitted.overrides == {"min_size": 160} and fitted.features == "regions"


def test_the_same_weights_elsewhere_pass_other_boxes_are_refused(weights, tmp_path):
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(weights.read_bytes())
    run = record(weights, max_boxes=10)
    asked = ExtractConfig(preset=SMALL_PRESET, weights=str(copy), min_boxes=10, max_boxes=10)
    given = {"weights", "preset", "min_boxes", "max_boxes"}
    assert config_for_run(run, asked, given, "r").weights == str(copy)
    with pytest.raises(InputError, match=r"max_boxes 10 \(here: 36\)") as exc:
        config_for_run(run, ExtractConfig(preset=SMALL_PRESET), {"preset", "min_boxes", "max_boxes"}, "r")
    assert "min_boxes 10 (here: 36)" in str(exc.value) and len(str(exc.value).splitlines()) == 1


def test_other_or_missing_weights_are_refused(weights, tmp_path):
    other = tmp_path / "other.safetensors"
    other.write_bytes(b"another detector")
    with pytest.raises(InputError, match=r"detector weights .*detector.safetensors .*\(here: .*other"):
        config_for_run(record(weights), ExtractConfig(weights=str(other)), {"weights"}, "r")
    with pytest.raises(InputError, match=r"detector weights random \(here: "):
        config_for_run(record(None), ExtractConfig(weights=str(other)), {"weights"}, "r")
    run = record(weights)
    weights.unlink()
    with pytest.raises(InputError, match="which are gone; give the same weights with --detector-weights"):
        config_for_run(run, ExtractConfig(), set(), "r")


def test_a_grid_run_extracts_its_grid(weights):
    fitted = config_for_run(record(weights, grid="4x4"), ExtractConfig(), set(), "r")
    assert (fitted.features, fitted.grid) == ("grid", "4x4")
    with pytest.raises(InputError, match="features 'grid' \\(here: 'regions'\\)"):
        config_for_run(record(weights, grid="4x4"), ExtractConfig(features="regions"), {"features"}, "r")


def test_evaluate_images_refuses_in_one_line_or_extracts_as_the_run(tmp_path, weights, monkeypatch, capsys):
    """The issue's case: a run trained on 10 boxes of runs/detector/best, evaluated with the same weights
    and a 36-box config, used to read another store and print a score."""
    import pipelines.jobs.image_cache as image_cache

    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_FILE).write_text(json.dumps({"task": "vqa", "detector": record(weights, max_boxes=10)}))
    photos = tmp_path / "photos"
    photos.mkdir()
    split = tmp_path / "questions.csv"
    split.write_text("image,question,answer\na.jpg,what?,red\n")
    ec36 = tmp_path / "ec36.yaml"
    ec36.write_text(yaml.safe_dump({"preset": SMALL_PRESET, "max_boxes": 36, "min_boxes": 10}))
    seen = []

    def images_store(images, refs, cfg, cache):
        seen.append(cfg)
        raise InputError("stopped before extracting")

    monkeypatch.setattr(image_cache, "images_store", images_store)
    argv = ["evaluate", "vqa", "--checkpoint", str(run), "--images", str(photos), "--split", str(split)]
    argv += ["--out", str(tmp_path / "p.json"), "--detector-weights", str(weights)]
    assert main([*argv, "--extract-config", str(ec36)]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "max_boxes 10 (here: 36)" in err[0] and str(run) in err[0], err
    assert seen == []
    assert main(argv) == 1
    assert "stopped before extracting" in capsys.readouterr().err
    (cfg,) = seen
    assert (cfg.preset, cfg.weights, cfg.max_boxes) == (SMALL_PRESET, str(weights), 10)


@pytest.fixture
def own_detector(tmp_path):
    """A trained detector's directory (random weights): 9 classes and 6 attributes, not the preset's."""
    import dataclasses

    from extraction.config import PRESETS
    from extraction.rcnn import VGFasterRCNN, init_random_weights
    from extraction.weights import save_detector_dir

    config = dataclasses.replace(PRESETS[SMALL_PRESET], num_classes=9, num_attributes=6, min_size=64)
    model = VGFasterRCNN(config)
    init_random_weights(model, 3)
    directory = tmp_path / "runs" / "detector" / "best"
    classes, attributes = [f"shape{i}" for i in range(9)], [f"colour{i}" for i in range(6)]
    save_detector_dir(model.eval(), config, SMALL_PRESET, classes, attributes, directory)
    return directory


def test_evaluation_after_an_own_detector_run_names_the_training_store(own_detector, tmp_path, monkeypatch):
    """`finetune --images --detector-weights runs/detector/best` extracts with no overrides; `evaluate
    --images` rebuilds the settings from the run's record, which names the detector's class counts (they
    differ from the preset's). Both must name one store, so evaluation extracts nothing again."""
    from dataclasses import replace

    from pipelines.jobs.image_cache import cache_store_path

    monkeypatch.chdir(tmp_path)  # the user's relative path, as they typed it
    trained = ExtractConfig(preset=SMALL_PRESET, weights="runs/detector/best", min_boxes=10, max_boxes=10)
    run = record(own_detector, max_boxes=10)
    assert run["config"]["num_classes"] == 9  # what the run records: not the preset's counts
    evaluated = config_for_run(run, ExtractConfig(), set(), "r")
    assert evaluated.overrides != trained.overrides  # spelled otherwise, the same features
    photos = tmp_path / "photos"
    assert cache_store_path(photos, evaluated) == cache_store_path(photos, trained)
    # what does change the features still names another store: the boxes, the input size, the weights
    assert cache_store_path(photos, replace(trained, max_boxes=12)) != cache_store_path(photos, trained)
    smaller = replace(trained, overrides={"min_size": 48})
    assert cache_store_path(photos, smaller) != cache_store_path(photos, trained)
    assert cache_store_path(photos, replace(trained, weights=None)) != cache_store_path(photos, trained)


def test_a_store_from_an_own_detector_names_it_not_the_vg_release(own_detector, weights):
    """The provenance's `detector` says what made the features: an own 9-class detector is not the
    released VG Faster R-CNN."""
    own = record(own_detector)["detector"]
    assert "vg-faster-rcnn" not in own
    assert str(own_detector) in own and "9 classes" in own and "shape0" in own
    assert record(weights)["detector"] != "vg-faster-rcnn-r101-c4"  # c4-small weights of a file
    assert "random weights" in record(None)["detector"]
