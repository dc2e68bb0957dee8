"""What the extraction job is told (`ExtractConfig`, one place for its defaults), what it reports, and the
settings it records in the store so that a resumed run cannot mix detectors."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from extraction.config import DEFAULT_PRESET, DetectorConfig
from extraction.grid import DEFAULT_GRID, FEATURE_KINDS, GridConfig
from extraction.rcnn import FORWARD_MODES
from extraction.selection import SelectionConfig
from pipelines.engine import config_io
from pipelines.jobs.image_inputs import InputError

# none: the driver writes one store; per-replica: each replica writes its own shard of a shard set
SHARD_MODES = ("none", "per-replica")
SETTINGS_KEYS = (
    "features",
    "grid",
    "preset",
    "selection",
    "min_boxes",
    "max_boxes",
    "overrides",
    "weights_sha256",
)
# what a store made before grid features existed recorded implicitly
SETTINGS_DEFAULTS = {"features": "regions", "grid": None}


@dataclass
class ExtractConfig:
    """Everything `xmodal extract` can be told; one place for the defaults."""

    RANGES: ClassVar[dict[str, str]] = {
        "min_boxes": "[1, 4096]",
        "max_boxes": "[1, 4096]",
        "batch_size": "[1, 4096]",
        "unit_batches": "[1, 65536]",
        "workers": "[1, 65536]",
        "gpus_per_worker": "[0, 64]",
        "cpus_per_worker": "(0, 1024]",
        "max_failures": ">= 0",
        "max_attempts": "[1, 100]",
        "startup_timeout": "(0, 1000000]",
        "decode_timeout": "(0, 1000000]",
        "commit_seconds": "(0, 1000000]",
    }

    inputs: list[str] = field(default_factory=list)  # image folders, list files or images
    out: str = ""  # the feature store to create or resume
    recursive: bool = False
    id_from: str = "stem"
    only_ids: list[str] | None = None  # extract just these ids of the listing (None: all)
    features: str = "regions"  # or "grid": res5 over the whole image, pooled to `grid`'s cells
    grid: str = DEFAULT_GRID  # ROWSxCOLS or native/K; read only with features: grid
    preset: str = DEFAULT_PRESET
    weights: str | None = None
    selection: str = "caffe"
    min_boxes: int = 36
    max_boxes: int = 36
    overrides: dict = field(default_factory=dict)  # Detector.build overrides (min_size, max_size, ...)
    batch_size: int = 4
    # per-image: one image at a time (the reference); batched: a batch's images through the trunk together
    # on padded canvases, their RoIs through res5 in one call; auto: batched on GPUs, per-image on CPU
    forward: str = "auto"  # one of FORWARD_MODES
    shards: str = "none"  # one of SHARD_MODES
    unit_batches: int = 8  # with shards: detector batches per work unit (the driver's cost is per unit)
    workers: int | None = None  # None (`--workers auto`): one per GPU (every GPU), else one CPU replica
    gpus_per_worker: float = 1.0
    cpus_per_worker: float | None = None  # None: 1 with GPUs, else the CPUs left after decoding, shared
    address: str | None = None
    max_failures: int = 0
    max_attempts: int = 3  # tries per image (a batch, then alone) before it is recorded as failed
    startup_timeout: float = 600.0  # seconds to wait for the replicas to be placed and built
    decode_timeout: float = 60.0  # seconds to read and decode one image before it is skipped
    dtype: str = "float16"
    commit_seconds: float = 2.0  # commit at least this often, so a kill loses seconds of work
    progress: bool = True
    include_dashboard: bool = True

    def __post_init__(self) -> None:
        # detector settings (`--set`, `overrides.KEY=VALUE`) are checked when the config is resolved
        config_io.check_mapping_field((DetectorConfig, SelectionConfig), self.overrides, "overrides")


class JobError(RuntimeError):
    """The job cannot go on: its replicas cannot be placed, or keep dying whatever they are given."""


@dataclass
class ExtractSummary:
    store: str
    errors: str
    total: int
    done: int
    skipped: int
    failed: int
    images_per_s: float  # while extracting: from the first batch sent to the last result written
    elapsed_s: float  # the whole command, listing and Ray start-up included
    startup_s: float  # listing, Ray start-up and replicas built
    replicas: int
    restarts: int
    device: str
    exit_code: int
    shards: str = "none"
    driver_cpu_ms_per_image: float = 0.0  # the driver process's CPU while extracting, per image handled


def errors_path(out: str | Path) -> Path:
    """`feats.lmdb` -> `feats.errors.jsonl`, beside the store."""
    return Path(out).with_suffix(".errors.jsonl")


def summary_path(out: str | Path) -> Path:
    """`feats.lmdb` -> `feats.summary.json`, beside the store."""
    return Path(out).with_suffix(".summary.json")


def grid_config(cfg: ExtractConfig) -> GridConfig | None:
    """The grid of a grid-feature job (ValueError naming the setting when it is not one), else None."""
    if cfg.features not in FEATURE_KINDS:
        raise ValueError(f"--features {cfg.features!r} is not one of {', '.join(FEATURE_KINDS)}")
    return GridConfig.parse(cfg.grid) if cfg.features == "grid" else None


def check_forward(cfg: ExtractConfig) -> None:
    """ValueError naming the setting when `forward` is not one of FORWARD_MODES."""
    if cfg.forward not in FORWARD_MODES:
        raise ValueError(f"--forward {cfg.forward!r} is not one of {', '.join(FORWARD_MODES)}")


def working_size(cfg: ExtractConfig) -> tuple[int, int]:
    """The detector's (min_size, max_size): what the decoders resize to before an image crosses to a
    replica (a detector directory's own sizes unless overridden)."""
    from extraction.weights import resolve_detector

    config = resolve_detector(
        cfg.preset, cfg.weights, cfg.selection, cfg.min_boxes, cfg.max_boxes, **cfg.overrides
    )[0]
    return config.min_size, config.max_size


def build_kwargs(cfg: ExtractConfig, device: str) -> dict:
    grid = grid_config(cfg)
    return dict(
        grid=grid.spec if grid is not None else None,
        forward=cfg.forward,
        preset=cfg.preset,
        weights=cfg.weights,
        device=device,
        selection=cfg.selection,
        min_boxes=cfg.min_boxes,
        max_boxes=cfg.max_boxes,
        **cfg.overrides,
    )


def running_preset(cfg: ExtractConfig) -> str:
    """The preset that runs: a trained detector directory's own (`weights`), else `preset`; what the
    store's provenance records beside these settings."""
    from extraction.weights import is_detector_dir, read_detector_dir

    if cfg.weights and is_detector_dir(cfg.weights):
        return read_detector_dir(cfg.weights)["preset"]
    return cfg.preset


def recorded_settings(cfg: ExtractConfig, provenance: dict | None) -> dict:
    """What decides the features; a resumed store must have been made with the same.

    Without `provenance` (before any replica has hashed the weights) the checksum is left out.
    """
    grid = grid_config(cfg)
    settings = {
        "features": cfg.features,
        "grid": grid.spec if grid is not None else None,
        "preset": running_preset(cfg),
        "selection": cfg.selection,
        # a grid's cells are its box count; --min-boxes/--max-boxes do not apply
        "min_boxes": cfg.min_boxes if grid is None else None,
        "max_boxes": cfg.max_boxes if grid is None else None,
        "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(cfg.overrides.items())},
    }
    if provenance is not None:
        settings["weights_sha256"] = provenance.get("weights_sha256") or "random"
    return settings


def check_store_fits(out: Path, meta: dict, cfg: ExtractConfig) -> None:
    """An existing store takes this job's records: same feature width, box count and dtype; else InputError
    before Ray starts, naming the store and the difference."""
    from extraction.weights import resolve_detector

    detector = {k: v for k, v in cfg.overrides.items() if k not in ("min_size", "max_size")}
    config = resolve_detector(
        cfg.preset, cfg.weights, cfg.selection, cfg.min_boxes, cfg.max_boxes, **detector
    )[0]
    grid = grid_config(cfg)
    max_boxes = grid.max_cells(config) if grid is not None else cfg.max_boxes
    wanted = {"feature_dim": config.feature_dim, "max_boxes": max_boxes, "dtype": cfg.dtype}
    differ = [k for k, v in wanted.items() if meta.get(k) != v]
    if differ:
        detail = ", ".join(f"{k} {meta.get(k)!r} (this job: {wanted[k]!r})" for k in differ)
        raise InputError(
            f"{out} holds records of another shape: {detail}; write to a new --out, or match the store's "
            "settings (detector preset, --max-boxes or --grid, dtype)"
        )


def check_weights(path: str) -> None:
    """The detector checkpoint reads as tensors (no pickled code), checked before Ray starts."""
    from extraction.weights import (
        CheckpointError,
        is_detector_dir,
        read_checkpoint,
        read_detector_dir,
        weights_file,
    )

    if not Path(path).is_file() and not is_detector_dir(path):
        raise InputError(
            f"--weights {path} is neither a checkpoint file nor a detector directory (RUN/best of "
            "`xmodal detector train`); see `xmodal convert detector`"
        )
    try:
        if is_detector_dir(path):
            read_detector_dir(path)
        read_checkpoint(weights_file(path))
    except CheckpointError as exc:
        raise InputError(str(exc).splitlines()[0]) from exc


def check_same_settings(out: Path, old: dict | None, new: dict) -> None:
    if old is None:
        return

    def recorded(key: str):
        return old.get(key, SETTINGS_DEFAULTS.get(key))

    changed = [k for k in SETTINGS_KEYS if k in new and recorded(k) != new[k]]
    if changed:
        detail = ", ".join(f"{k}: {recorded(k)!r} -> {new.get(k)!r}" for k in changed)
        raise InputError(
            f"{out} was extracted with other settings ({detail}); resuming would mix features: "
            f"choose a new --out or the original settings"
        )
