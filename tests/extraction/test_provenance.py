"""Provenance records what made a store; `detector_settings` turns a record back into build arguments."""

from __future__ import annotations

import hashlib
import json

import pytest

from extraction.config import PRESETS, resolve_config
from extraction.provenance import detector_settings, provenance, weights_record


def recorded(preset: str = "vg-r101-c4", weights: dict | None = None, **kwargs) -> dict:
    """A provenance record as a store holds it (through JSON: tuples become lists)."""
    config, selection = resolve_config(preset, **kwargs)
    record = provenance(preset, config, selection, weights or weights_record(None, 0), 2048)
    return json.loads(json.dumps(record))


def test_detector_provenance_and_feature_dim(small_detector):
    prov = small_detector.provenance()
    assert prov["preset"] == "vg-r101-c4" and prov["weights"] == "random"
    assert prov["selection"] == "caffe" and (prov["min_boxes"], prov["max_boxes"]) == (2, 6)
    assert prov["config"]["min_size"] == 64 and prov["config"]["post_nms_topk"] == 8
    assert {"torch", "torchvision"} <= set(prov["versions"])
    assert small_detector.feature_dim == prov["feature_dim"] == 2048


def test_settings_keep_only_what_differs_from_the_preset():
    """Settings equal to the preset's (max_size, anchor_ratios, nms_thresh) are left to the preset."""
    record = recorded(
        selection="caffe",
        min_boxes=8,
        max_boxes=8,
        min_size=96,
        max_size=1000,
        post_nms_topk=12,
        conf_thresh=0.1,
        anchor_ratios=[0.5, 1.0, 2.0],
        nms_thresh=0.3,
    )
    assert detector_settings(record) == {
        "preset": "vg-r101-c4",
        "selection": "caffe",
        "min_boxes": 8,
        "max_boxes": 8,
        "min_size": 96,
        "post_nms_topk": 12,
        "conf_thresh": 0.1,
        "weights": None,
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"selection": "maxnms", "min_boxes": 10, "max_boxes": 100, "maxnms_thresholds": [0.4, 0.6]},
        {"selection": "threshold", "score_thresh": 0.3, "pixel_std": [57.4, 57.1, 58.4], "dtype": "bfloat16"},
    ],
)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_settings_rebuild_the_recorded_configs(preset, kwargs):
    settings = detector_settings(recorded(preset, **kwargs))
    assert settings.pop("weights") is None
    assert resolve_config(**settings) == resolve_config(preset, **kwargs)


def test_weights_are_reused_only_while_the_file_exists(tmp_path):
    path = tmp_path / "det.safetensors"
    path.write_bytes(b"weights")
    weights = weights_record(path, 0, {"missing": 0})
    assert weights["sha256"] == hashlib.sha256(b"weights").hexdigest()
    record = recorded(weights=weights)
    assert record["weights"] == str(path) and record["weights_sha256"] == weights["sha256"]
    assert detector_settings(record)["weights"] == str(path)
    path.unlink()
    assert detector_settings(record)["weights"] is None


def test_unknown_preset_and_keys_fall_back_to_the_defaults():
    record = recorded()
    record["preset"] = "r50-from-the-future"
    record["config"]["new_knob"] = 3
    record["selection_config"]["other"] = 1
    assert detector_settings(record) == {
        "preset": "vg-r101-c4",
        "selection": "caffe",
        "min_boxes": 36,
        "max_boxes": 36,
        "weights": None,
    }
    assert detector_settings({}) == {"preset": "vg-r101-c4", "weights": None}
