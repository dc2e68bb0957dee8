"""Detector checkpoints: detectron2 .pkl (restricted unpickler), HuggingFace .bin, safetensors.

Names and shapes are checked against the model; a report lists every missing, unexpected and
mismatched name, and loading refuses unless `strict=False`.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from extraction.config import DEFAULT_PRESET, preset_config
from extraction.rcnn import VGFasterRCNN

log = logging.getLogger(__name__)

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
PICKLE_SUFFIXES = (".pkl", ".pickle")
ANCHORS_KEY = "proposal_generator.anchor_generator.cell_anchors.0"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the detector; `report` says how it does not fit
    (None when it could not be read)."""

    def __init__(self, message: str, report: LoadReport | None = None):
        super().__init__(message)
        self.report = report


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Rebuilds numpy arrays and plain containers; any other global is refused, so nothing runs."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("collections", "OrderedDict"),
        ("_codecs", "encode"),  # how Python 3 pickles bytes at protocol 2 (array data)
        ("builtins", "bytes"),
        ("__builtin__", "bytes"),
        ("builtins", "bytearray"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: only numpy arrays and plain containers are allowed"
        )


@dataclass
class LoadReport:
    """How a checkpoint's names and shapes compare with the model's."""

    source: str
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "name: checkpoint (a, b) vs model (c, d)"
    ignored: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self) -> dict:
        return {k: len(getattr(self, k)) for k in ("missing", "unexpected", "mismatched", "ignored")}

    def __str__(self) -> str:
        lines = [f"checkpoint {self.source}:"]
        for kind in ("missing", "unexpected", "mismatched"):
            names = getattr(self, kind)
            if names:
                lines.append(f"  {len(names)} {kind}:")
                lines.extend(f"    {n}" for n in names)
        if len(lines) == 1:
            lines.append("  all names and shapes match")
        return "\n".join(lines)


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The {name: tensor} state of a detectron2 .pkl, a torch .bin/.pt/.pth or a .safetensors file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"detector checkpoint {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix in PICKLE_SUFFIXES:
            with open(path, "rb") as f:
                obj = _ArraysOnlyUnpickler(io.BufferedReader(f), encoding="latin1").load()
        elif suffix in TORCH_SUFFIXES:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        elif suffix == ".safetensors":
            from safetensors.torch import load_file

            obj = load_file(path)
        else:
            raise CheckpointError(
                f"detector checkpoint {str(path)!r}: unknown suffix {suffix!r}; "
                f"use {PICKLE_SUFFIXES + TORCH_SUFFIXES + ('.safetensors',)}"
            )
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"detector checkpoint {str(path)!r} cannot be read: {load_failure(exc)}"
        ) from exc
    return _as_state(obj, path)


def load_failure(exc: BaseException) -> str:
    """One line saying why a checkpoint did not load; torch's weights-only refusal spans a page."""
    text = str(exc)
    if "Weights only load failed" not in text:
        return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    detail = next(
        (line.removeprefix("WeightsUnpickler error:").strip() for line in lines if "GLOBAL" in line),
        next((line for line in lines if line.startswith("Unsupported operand")), "not a plain tensor file"),
    )
    return (
        f"not a tensor-only file (torch's safe loader: {detail}); refused, as loading it fully could run "
        "code: convert it where it came from, or give the released checkpoint"
    )


def _as_state(obj, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(obj, dict):
        for key in ("model", "state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"detector checkpoint {str(path)!r} holds a {type(obj).__name__}, not a state dict"
        )
    if "blobs" in obj:
        raise CheckpointError(f"{str(path)!r} is a caffe2 Detectron checkpoint; use the detectron2 .pkl")
    state = {}
    for name, value in obj.items():
        if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
            state[str(name)] = torch.from_numpy(np.ascontiguousarray(value))
        elif isinstance(value, torch.Tensor):
            state[str(name)] = value
        else:
            raise CheckpointError(
                f"detector checkpoint {str(path)!r}: entry {name!r} is a {type(value).__name__}, not an array"
            )
    return state


def check_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> LoadReport:
    """Compare names and shapes; `num_batches_tracked` and the anchor buffer are ignored (anchors
    only when they equal the model's)."""
    expected = model.state_dict()
    report = LoadReport(source)
    for name, tensor in state.items():
        if name.endswith("num_batches_tracked"):
            report.ignored.append(name)
        elif name == ANCHORS_KEY:
            ours = model.proposal_generator.anchor_generator.cell_anchors
            if tuple(tensor.shape) == tuple(ours.shape) and (
                ours.is_meta or torch.allclose(tensor.float(), ours.float().cpu(), atol=1e-3)
            ):
                report.ignored.append(name)
            else:
                report.mismatched.append(f"{name}: the checkpoint's anchors differ from the preset's")
        elif name not in expected:
            report.unexpected.append(name)
        elif tuple(tensor.shape) != tuple(expected[name].shape):
            report.mismatched.append(
                f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(expected[name].shape)}"
            )
    report.missing = [name for name in expected if name not in state]
    return report


def load_detector_weights(model: nn.Module, path: str | Path, strict: bool = True) -> LoadReport:
    """Load a checkpoint into `model`; raises CheckpointError listing the problems unless strict=False."""
    state = read_checkpoint(path)
    report = check_state(model, state, str(path))
    if not report.ok:
        if strict:
            raise CheckpointError(
                f"{report}\nfix the checkpoint or pass strict=False to load it anyway", report
            )
        log.warning("%s\nloading the matching tensors only (strict=False)", report)
    bad = set(report.unexpected) | {m.split(":")[0] for m in report.mismatched}
    usable = {k: v for k, v in state.items() if k not in bad and k not in report.ignored}
    model.load_state_dict(usable, strict=False)
    return report


def convert_detector_checkpoint(
    src: str | Path, dst: str | Path, strict: bool = True, preset: str = DEFAULT_PRESET
) -> LoadReport:
    """Check a detectron2 .pkl / HuggingFace .bin / safetensors checkpoint against `preset`'s network and
    write it as safetensors."""
    from safetensors.torch import save_file

    config = preset_config(preset)
    with torch.device("meta"):
        model = VGFasterRCNN(config)
    state = read_checkpoint(src)
    report = check_state(model, state, str(src))
    if not report.ok:
        if strict:
            raise CheckpointError(f"{report}\nfix the checkpoint or pass strict=False (--no-strict)", report)
        log.warning("%s\nwriting the matching tensors only (strict=False)", report)
    expected = model.state_dict()
    out = {
        k: v.contiguous()
        for k, v in state.items()
        if k in expected and tuple(v.shape) == tuple(expected[k].shape)
    }
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".tmp")
    save_file(
        out, str(tmp), metadata={"format": "xmodal-detector", "preset": preset, "source": Path(src).name}
    )
    os.replace(tmp, dst)
    log.info("wrote %d tensors to %s", len(out), dst)
    return report


# ---- xmodal detector directories (what `xmodal detector train` writes: RUN/best, RUN/last)
DETECTOR_FILE = "detector.json"
WEIGHTS_FILE = "model.safetensors"
DIRECTORY_FORMAT = "xmodal-detector"
# the predictor layers whose shapes follow the class list or the attribute list
CLASS_HEADS = (
    "roi_heads.box_predictor.cls_score",
    "roi_heads.box_predictor.bbox_pred",
    "roi_heads.box_predictor.cls_embedding",
)
ATTRIBUTE_HEADS = ("roi_heads.box_predictor.attr_score",)


def is_detector_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / DETECTOR_FILE).is_file()


def save_detector_dir(
    model: nn.Module, config, preset: str, classes: list[str], attributes: list[str], directory: str | Path
) -> None:
    """Weights (safetensors, detectron2 names) and detector.json: the full config and the class and
    attribute names, so extraction, pictures, `ask` and `serve` rebuild the same detector with names."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    if len(classes) != config.num_classes or len(attributes) != config.num_attributes:
        raise ValueError(
            f"{len(classes)} class names / {len(attributes)} attribute names for a detector with "
            f"{config.num_classes} classes / {config.num_attributes} attributes"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": DIRECTORY_FORMAT, "preset": preset})
    meta = {
        "format": DIRECTORY_FORMAT,
        "preset": preset,
        "config": dataclasses.asdict(config),
        "classes": list(classes),
        "attributes": list(attributes),
    }
    (directory / DETECTOR_FILE).write_text(json.dumps(meta, indent=1))


def read_detector_dir(directory: str | Path) -> dict:
    """detector.json of an xmodal detector directory, checked: format, config, names."""
    import json

    path = Path(directory) / DETECTOR_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: cannot be read as JSON ({exc}); is this a detector run directory?"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != DIRECTORY_FORMAT:
        raise CheckpointError(f"{path}: not an xmodal detector description (format {DIRECTORY_FORMAT!r})")
    for key, kind in (("config", dict), ("classes", list), ("attributes", list), ("preset", str)):
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{path}: {key!r} is missing or not a {kind.__name__}")
    if not (Path(directory) / WEIGHTS_FILE).is_file():
        raise CheckpointError(f"{directory}: {WEIGHTS_FILE} is missing beside {DETECTOR_FILE}")
    return meta


def resolve_detector(
    preset: str, weights: str | Path | None, selection: str, min_boxes: int, max_boxes: int, **overrides
):
    """(DetectorConfig, SelectionConfig, preset, class names, attribute names) for `Detector.build`'s
    arguments: a detector directory brings its own architecture, preset and names (architecture overrides
    that would change it are refused); otherwise the preset with the overrides, and no names."""
    from extraction.config import ARCHITECTURE_FIELDS, config_from_dict, resolve_config

    base = classes = attributes = None
    if weights is not None and is_detector_dir(weights):
        meta = read_detector_dir(weights)
        base, preset = config_from_dict(meta["config"]), meta["preset"]
        classes, attributes = meta["classes"], meta["attributes"]
        changed = sorted(
            k for k in overrides if k in ARCHITECTURE_FIELDS and overrides[k] != getattr(base, k)
        )
        if changed:
            raise CheckpointError(
                f"{weights}: {changed} would change the trained network's architecture; leave them out"
            )
    config, sel = resolve_config(preset, selection, min_boxes, max_boxes, base=base, **overrides)
    return config, sel, preset, classes, attributes


def effective_overrides(
    preset: str, weights: str | Path | None, selection: str, min_boxes: int, max_boxes: int, **overrides
) -> dict:
    """The `overrides` that change something: those whose value differs from what the preset, or a
    detector directory's own config, already holds (a run's recorded settings name a trained detector's
    class counts; its directory carries them too)."""
    import dataclasses

    config, sel, _, _, _ = resolve_detector(preset, weights, selection, min_boxes, max_boxes)
    held = {**dataclasses.asdict(sel), **dataclasses.asdict(config)}
    plain = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return {k: overrides[k] for k, v in plain.items() if k not in held or held[k] != v}


def weights_file(path: str | Path) -> Path:
    """The tensor file behind `path`: the file itself, or a detector directory's model.safetensors."""
    return Path(path) / WEIGHTS_FILE if Path(path).is_dir() else Path(path)


@dataclass
class InitReport:
    """What a training run took from its starting checkpoint."""

    source: str
    loaded: int = 0
    rebuilt: list[str] = field(default_factory=list)  # heads left at their fresh init, with the reason
    missing: list[str] = field(default_factory=list)  # other tensors the checkpoint lacks (fresh init)
    unexpected: list[str] = field(default_factory=list)


def init_from_checkpoint(
    model: nn.Module,
    path: str | Path,
    classes: list[str] | None = None,
    attributes: list[str] | None = None,
) -> InitReport:
    """Start training from a checkpoint: released VG weights, a backbone-only file or an xmodal detector
    directory. Heads whose class or attribute list differs from the checkpoint's (by count, or by name
    where the checkpoint records names) keep their fresh initialisation and are named in the report; every
    other tensor of the same name and shape is loaded."""
    state = read_checkpoint(weights_file(path))
    report = InitReport(str(path))
    names = read_detector_dir(path) if is_detector_dir(path) else {}
    expected = model.state_dict()
    drop: set[str] = set()
    for heads, ours, theirs, what in (
        (CLASS_HEADS, classes, names.get("classes"), "class"),
        (ATTRIBUTE_HEADS, attributes, names.get("attributes"), "attribute"),
    ):
        for head in heads:
            key = f"{head}.weight"
            if key not in state or key not in expected:
                continue
            if tuple(state[key].shape) != tuple(expected[key].shape):
                reason = f"{what} list of {_count(head, state[key])} vs {_count(head, expected[key])}"
            elif ours is not None and theirs is not None and list(ours) != list(theirs):
                reason = f"{what} names differ from the checkpoint's"
            else:
                continue
            drop.update(k for k in state if k.startswith(head + "."))
            report.rebuilt.append(f"{head} ({reason})")
    for name, tensor in state.items():
        if name.endswith("num_batches_tracked") or name == ANCHORS_KEY or name in drop:
            continue
        if name not in expected or tuple(tensor.shape) != tuple(expected[name].shape):
            report.unexpected.append(name)
    usable = {
        k: v
        for k, v in state.items()
        if k in expected and k not in drop and tuple(v.shape) == tuple(expected[k].shape)
    }
    model.load_state_dict(usable, strict=False)
    report.loaded = len(usable)
    report.missing = [k for k in expected if k not in usable and k not in drop]
    for line in report.rebuilt:
        log.info("rebuilt %s: it starts from a fresh initialisation", line)
    if report.missing:
        log.warning(
            "%s lacks %d of the detector's tensors (fresh initialisation): %s",
            path,
            len(report.missing),
            ", ".join(report.missing[:8]) + (" ..." if len(report.missing) > 8 else ""),
        )
    if report.unexpected:
        log.warning(
            "%s: %d tensors fit no part of this detector and were left out", path, len(report.unexpected)
        )
    return report


def _count(head: str, weight: torch.Tensor) -> int:
    """How many classes or attributes a head's weight is sized for."""
    rows = int(weight.shape[0])
    if head.endswith("bbox_pred"):
        return rows // 4
    return rows - 1  # cls_score, cls_embedding: + background; attr_score: + "no attribute"
