"""`evaluate --images` extracts as the run's training features were, or refuses naming the difference."""

from __future__ import annotations

import json

import pytest
import yaml

from extraction.config import SMALL_PRESET
from extraction.grid import GridConfig
from extraction.provenance import provenance, sha256
from extraction.weights import resolve_detector
from pipelines.cli import main
from pipelines.jobs.extract.config import ExtractConfig
from pipelines.jobs.image_cache import config_for_run
from pipelines.jobs.image_inputs import InputError
from pipelines.tasks.finetune import RUN_FILE


def record(weights=None, max_boxes: int = 10, grid: str | None = None, **overrides) -> dict:
    """The provenance a store extracted with these settings carries (as a fine-tuning run records it)."""
    config, sel, preset, _, _ = resolve_detector(
        SMALL_PRESET, weights, "caffe", max_boxes, max_boxes, **overrides
    )
    info = {"path": "random", "sha256": None}
    if weights is not None:
        info = {"path": str(weights), "sha256": sha256(weights)}
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
