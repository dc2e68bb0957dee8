"""What produced a feature store (preset, configs, weights, versions), and its inverse: the
`Detector.build` arguments that reproduce a recorded extraction."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import platform
from pathlib import Path

import numpy as np
import torch

from extraction.config import DEFAULT_PRESET, PRESETS, DetectorConfig
from extraction.grid import GridConfig
from extraction.selection import SelectionConfig

log = logging.getLogger(__name__)

DETECTOR_NAME = "vg-faster-rcnn-r101-c4"
# SelectionConfig fields that Detector.build takes as its own arguments rather than as overrides
SELECTION_ARGUMENTS = {"rule": "selection", "min_boxes": "min_boxes", "max_boxes": "max_boxes"}


def weights_record(
    path: str | Path | None,
    seed: int,
    report: dict | None = None,
    classes: list[str] | None = None,
    attributes: list[str] | None = None,
) -> dict:
    """The weights part of the provenance: the file (or detector directory) and the sha256 of its tensors,
    and the class and attribute names where the weights carry them; or "random" and the seed."""
    if path is None:
        return {"path": "random", "sha256": None, "seed": seed}
    from extraction.weights import weights_file

    record = {"path": str(path), "sha256": sha256(weights_file(path)), "report": report}
    if classes is not None:
        record["classes"], record["attributes"] = list(classes), list(attributes or [])
    return record


def provenance(
    preset: str,
    config: DetectorConfig,
    selection: SelectionConfig,
    weights: dict,
    feature_dim: int,
    grid: GridConfig | None = None,
    call_shape: dict | None = None,
) -> dict:
    """What produced the features: preset, configs, weights (path + sha256 or random), versions, and
    whether they are regions or grid cells (then the grid, how it was pooled, and its cell count as the
    box counts); `call_shape`, when given, the network's fixed call shape (forward path, canvases per
    trunk call, RoIs per RoI-head call), which decides the records' last bits."""
    import cv2
    import PIL
    import torchvision

    min_boxes, max_boxes = selection.min_boxes, selection.max_boxes
    kind: dict = {"features": "regions"}
    if grid is not None:
        max_boxes = grid.max_cells(config)
        min_boxes = max_boxes if grid.pool is None else 1
        kind = {"features": "grid", "grid": grid.spec, "grid_method": grid.describe()}
    return {
        "detector": detector_name(preset, weights),
        **kind,
        "preset": preset,
        "config": dataclasses.asdict(config),
        "weights": weights["path"],
        "weights_sha256": weights["sha256"],
        "selection": selection.rule,
        "selection_config": dataclasses.asdict(selection),
        "min_boxes": min_boxes,
        "max_boxes": max_boxes,
        "feature_dim": int(feature_dim),
        "tf32": False,  # Detector.detect runs CUDA matmuls and convolutions in IEEE float32
        **({"call_shape": dict(call_shape)} if call_shape is not None else {}),
        **(
            {"classes": weights["classes"], "attributes": weights["attributes"]}
            if "classes" in weights
            else {}
        ),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchvision": torchvision.__version__,
            "numpy": np.__version__,
            "opencv": cv2.__version__,
            "pillow": PIL.__version__,
        },
    }


def detector_name(preset: str, weights: dict) -> str:
    """What made the features, in words: the released VG detector's name for the VG preset without names of
    its own, else the preset, the weights and the classes they were trained on (a detector directory of
    `xmodal detector train`)."""
    if "classes" in weights:
        classes = weights["classes"]
        shown = ", ".join(classes[:5]) + (f", ... ({len(classes)})" if len(classes) > 5 else "")
        return f"{preset} trained by xmodal: {weights['path']} ({len(classes)} classes: {shown})"
    if preset == DEFAULT_PRESET:
        return DETECTOR_NAME if weights["path"] != "random" else f"{DETECTOR_NAME} (random weights)"
    return f"{preset}: {weights['path']}" if weights["path"] != "random" else f"{preset} (random weights)"


def detector_settings(recorded: dict) -> dict:
    """`Detector.build` keyword arguments that reproduce the extraction `recorded` by `provenance`: preset,
    selection rule, box counts, the grid for grid features, every setting that differed from the preset
    (input size, proposals, thresholds...) and the weights file if it still exists (else `weights=None`,
    random weights).

    Keys this version does not know are ignored; an unknown preset falls back to the default one.
    """
    preset = recorded.get("preset") if recorded.get("preset") in PRESETS else DEFAULT_PRESET
    settings: dict = {"preset": preset}
    if recorded.get("selection"):
        settings["selection"] = recorded["selection"]
    if recorded.get("features") == "grid" and isinstance(recorded.get("grid"), str):
        settings["grid"] = recorded["grid"]
    else:
        for key in ("min_boxes", "max_boxes"):
            if isinstance(recorded.get(key), int):
                settings[key] = recorded[key]
    defaults = {
        "config": dataclasses.asdict(PRESETS[preset]),
        "selection_config": {
            k: v for k, v in dataclasses.asdict(SelectionConfig()).items() if k not in SELECTION_ARGUMENTS
        },
    }
    for section, known in defaults.items():
        for key, value in (recorded.get(section) or {}).items():
            if key in known and _plain(value) != _plain(known[key]):
                settings[key] = _plain(value)
    path = recorded.get("weights")
    weights = None
    if path and path != "random":
        if Path(path).is_file() or Path(path).is_dir():
            weights = path
            log.info("using the detector weights the features were made with: %s", path)
        else:
            log.warning("the detector weights the features were made with (%s) are gone", path)
    settings["weights"] = weights
    return settings


# Provenance entries that decide what the features are; the configs are compared field by field.
_DECIDING = ("features", "grid", "weights_sha256", "selection", "min_boxes", "max_boxes", "feature_dim")


def differences(
    recorded: dict,
    preset: str = DEFAULT_PRESET,
    weights: str | Path | None = None,
    selection: str = "caffe",
    min_boxes: int = 36,
    max_boxes: int = 36,
    grid: str | GridConfig | None = None,
    **overrides,
) -> list[str]:
    """How features made with these `Detector.build` arguments would differ from the extraction `recorded`
    by `provenance`: one "name recorded (here: value)" per differing setting, the weights by their sha256;
    empty when they would be made alike. Entries `recorded` lacks (older stores) are not compared."""
    here = expected_provenance(preset, weights, selection, min_boxes, max_boxes, grid, **overrides)
    return provenance_differences(recorded, here)


def expected_provenance(
    preset: str = DEFAULT_PRESET,
    weights: str | Path | None = None,
    selection: str = "caffe",
    min_boxes: int = 36,
    max_boxes: int = 36,
    grid: str | GridConfig | None = None,
    **overrides,
) -> dict:
    """The provenance an extraction with these `Detector.build` arguments records (this process's
    versions), without building the detector: a detector directory's own architecture and names, the
    weights by their sha256."""
    from extraction.weights import resolve_detector, weights_file

    config, sel, preset, _, _ = resolve_detector(
        preset, weights, selection, min_boxes, max_boxes, **overrides
    )
    if isinstance(grid, str):
        grid = GridConfig.parse(grid)
    info = {"path": "random", "sha256": None}
    if weights is not None:
        info = {"path": str(weights), "sha256": sha256(weights_file(weights))}
    return provenance(preset, config, sel, info, config.feature_dim, grid)


def deciding_entries(record: dict) -> dict:
    """The entries of a provenance that decide what the features are (the weights by their sha256, the
    configs as resolved), not where the weights lie, how the settings were spelled, nor the versions."""
    return {key: record.get(key) for key in (*_DECIDING, "config", "selection_config")}


def provenance_differences(recorded: dict, here: dict) -> list[str]:
    """`differences` between two provenances (e.g. a run's training store and the store it is evaluated
    on). Entries `recorded` lacks (older stores) are not compared."""
    found = []
    for key in _DECIDING:
        if key in recorded and _plain(recorded[key]) != _plain(here.get(key)):
            if key == "weights_sha256":
                found.append(f"detector weights {_weights_name(recorded)} (here: {_weights_name(here)})")
            else:
                found.append(f"{key} {recorded[key]!r} (here: {here.get(key)!r})")
    for section in ("config", "selection_config"):
        mine = here.get(section) or {}
        for key, value in (recorded.get(section) or {}).items():
            if key in SELECTION_ARGUMENTS or key not in mine:
                continue  # the selection rule and the box counts are compared above
            if _plain(value) != _plain(mine[key]):
                found.append(f"{key} {value!r} (here: {mine[key]!r})")
    return found


def _weights_name(record: dict) -> str:
    if not record.get("weights_sha256"):
        return "random"
    return f"{record.get('weights')} (sha256 {record['weights_sha256'][:12]})"


def recorded_names(recorded: dict) -> tuple[list[str] | None, list[str] | None]:
    """(class names, attribute names) a store's provenance carries (weights trained with xmodal carry
    them), else (None, None)."""
    classes, attributes = recorded.get("classes"), recorded.get("attributes")
    if isinstance(classes, list) and isinstance(attributes, list):
        return [str(c) for c in classes], [str(a) for a in attributes]
    return None, None


def _plain(value):
    """JSON gives lists where the configs hold tuples."""
    return tuple(value) if isinstance(value, list) else value


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
