"""Typed detector configs and the named presets (architecture and test-time settings together)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from extraction.selection import RULES, SelectionConfig

DTYPES = ("float32", "float16", "bfloat16")
SELECTION_RULES = tuple(RULES)
# fields that shape the network (and so the checkpoint); the others are test-time settings
ARCHITECTURE_FIELDS = (
    "stem_channels",
    "res2_channels",
    "bottleneck_channels",
    "blocks_per_stage",
    "res5_blocks",
    "res5_dilation",
    "anchor_sizes",
    "anchor_ratios",
    "rpn_channels",
    "pooler_resolution",
    "num_classes",
    "num_attributes",
    "attr_embed_dim",
    "attr_hidden_dim",
)


@dataclass(frozen=True)
class DetectorConfig:
    """A Faster R-CNN ResNet C4 with the attribute head: its widths, depths and classes, and the test-time
    settings. The defaults are the Visual Genome R101-C4 of bottom-up attention."""

    # each setting's range, checked with its type where a config is resolved (pipelines' config_io)
    RANGES: ClassVar[dict[str, str]] = {
        "stem_channels": "[1, 4096]",
        "res2_channels": "[1, 4096]",
        "bottleneck_channels": "[1, 4096]",
        "blocks_per_stage": "[1, 256]",
        "res5_blocks": "[1, 256]",
        "res5_dilation": "[1, 8]",
        "anchor_sizes": "(0, 100000]",
        "anchor_ratios": "(0, 1000]",
        "rpn_channels": "[1, 8192]",
        "pooler_resolution": "[1, 64]",
        "num_classes": "[1, 1048576]",
        "num_attributes": "[0, 1048576]",
        "attr_embed_dim": "[1, 8192]",
        "attr_hidden_dim": "[1, 8192]",
        "min_size": "[1, 8192]",
        "max_size": "[1, 8192]",
        "pixel_mean": "[0, 255]",
        "pixel_std": "(0, 100000]",
        "pre_nms_topk": "[1, 1000000]",
        "post_nms_topk": "[1, 100000]",
        "rpn_nms_thresh": "[0, 1]",
        "bbox_reg_weights": "(0, 1000]",
    }

    # architecture (detectron2's RESNETS.STEM_OUT_CHANNELS, RES2_OUT_CHANNELS, WIDTH_PER_GROUP)
    stem_channels: int = 64
    res2_channels: int = 256  # res2's output; doubles at each stage, so res5 (the feature) is 8x this
    bottleneck_channels: int = 64  # res2's bottleneck; doubles likewise
    blocks_per_stage: tuple[int, int, int] = (3, 4, 23)  # res2, res3, res4 of ResNet-101
    res5_blocks: int = 3
    res5_dilation: int = 2
    anchor_sizes: tuple[float, ...] = (64.0, 128.0, 256.0, 512.0)
    anchor_ratios: tuple[float, ...] = (0.5, 1.0, 2.0)
    rpn_channels: int = 512
    pooler_resolution: int = 14
    num_classes: int = 1600
    num_attributes: int = 400
    attr_embed_dim: int = 256
    attr_hidden_dim: int = 512
    # test time
    min_size: int = 600
    max_size: int = 1000
    pixel_mean: tuple[float, float, float] = (102.9801, 115.9465, 122.7717)  # BGR
    pixel_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    pre_nms_topk: int = 6000
    post_nms_topk: int = 300
    rpn_nms_thresh: float = 0.7
    bbox_reg_weights: tuple[float, float, float, float] = (10.0, 10.0, 5.0, 5.0)
    dtype: str = "float32"  # float16/bfloat16 autocast the convolutions; box math stays float32

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 < self.min_size <= self.max_size:
            raise ValueError(f"need 0 < min_size <= max_size, got {self.min_size}/{self.max_size}")
        if self.post_nms_topk < 1 or self.pre_nms_topk < 1:
            raise ValueError("pre_nms_topk and post_nms_topk must be positive")
        if len(self.blocks_per_stage) != 3 or min(*self.blocks_per_stage, self.res5_blocks) < 1:
            raise ValueError(f"need one or more blocks in each of res2..res5, got {self.blocks_per_stage}")

    @property
    def feature_dim(self) -> int:
        """Width of a region feature: res5's output channels."""
        return self.res2_channels * 8

    def architecture(self) -> dict:
        """The fields that decide the network's parameters, names and shapes."""
        return {name: getattr(self, name) for name in ARCHITECTURE_FIELDS}


@dataclass(frozen=True)
class TrainingConfig:
    """How the detector trains: detectron2's R-C4 defaults (configs/Base-RCNN-C4.yaml, config/defaults.py)
    and bottom-up attention's attribute loss weight (see `extraction.predictor.attribute_loss`)."""

    RANGES: ClassVar[dict[str, str]] = {
        "rpn_iou_thresholds": "[0, 1]",
        "rpn_batch_size": "[1, 1000000]",
        "rpn_positive_fraction": "[0, 1]",
        "rpn_pre_nms_topk": "[1, 1000000]",
        "rpn_post_nms_topk": "[1, 1000000]",
        "roi_batch_size": "[1, 1000000]",
        "roi_positive_fraction": "[0, 1]",
        "roi_iou_threshold": "[0, 1]",
        "attr_loss_weight": "[0, 1000]",
        "freeze_at": "[0, 4]",
        "min_sizes": "[1, 8192]",
        "max_size": "[1, 8192]",
        "flip_prob": "[0, 1]",
    }

    rpn_iou_thresholds: tuple[float, float] = (0.3, 0.7)  # below: negative, above: positive
    rpn_batch_size: int = 256  # anchors sampled per image
    rpn_positive_fraction: float = 0.5
    rpn_pre_nms_topk: int = 12000
    rpn_post_nms_topk: int = 2000
    roi_batch_size: int = 512  # RoIs sampled per image
    roi_positive_fraction: float = 0.25
    roi_iou_threshold: float = 0.5
    attr_loss_weight: float = 0.5
    freeze_at: int = 2  # the stem and res2 keep their weights
    min_sizes: tuple[int, ...] = (640, 672, 704, 736, 768, 800)  # shortest edge, one drawn per image
    max_size: int = 1333
    flip_prob: float = 0.5

    def __post_init__(self) -> None:
        low, high = self.rpn_iou_thresholds
        if not 0 <= low <= high <= 1:
            raise ValueError(
                f"rpn_iou_thresholds must be 0 <= low <= high <= 1, got {self.rpn_iou_thresholds}"
            )
        for name in ("rpn_positive_fraction", "roi_positive_fraction", "roi_iou_threshold", "flip_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("rpn_batch_size", "rpn_pre_nms_topk", "rpn_post_nms_topk", "roi_batch_size", "max_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.min_sizes or min(self.min_sizes) < 1 or max(self.min_sizes) > self.max_size:
            raise ValueError(f"min_sizes must be positive sizes <= max_size, got {self.min_sizes}")
        if not 0 <= self.freeze_at <= 4:
            raise ValueError(f"freeze_at must be 0..4 (stem, res2, res3, res4), got {self.freeze_at}")
        if self.attr_loss_weight < 0:
            raise ValueError(f"attr_loss_weight must be >= 0, got {self.attr_loss_weight}")


DEFAULT_PRESET = "vg-r101-c4"
SMALL_PRESET = "c4-small"

PRESETS: dict[str, DetectorConfig] = {
    # LXMERT's extraction settings (bottom-up attention test config: 600/1000, 300 proposals)
    DEFAULT_PRESET: DetectorConfig(),
    # the same network at detectron2's stock test settings
    "vg-r101-c4-d2": DetectorConfig(min_size=800, max_size=1333, post_nms_topk=1000),
    # the same C4 design, narrow and shallow, for small images: trains on 2 CPU cores in minutes
    SMALL_PRESET: DetectorConfig(
        stem_channels=16,
        res2_channels=32,
        bottleneck_channels=8,
        blocks_per_stage=(1, 1, 1),
        res5_blocks=1,
        anchor_sizes=(16.0, 32.0, 64.0, 128.0),
        rpn_channels=64,
        pooler_resolution=7,
        num_classes=3,
        num_attributes=4,
        attr_embed_dim=32,
        attr_hidden_dim=64,
        min_size=224,
        max_size=384,
        pre_nms_topk=1000,
        post_nms_topk=100,
    ),
}

TRAINING_PRESETS: dict[str, TrainingConfig] = {
    DEFAULT_PRESET: TrainingConfig(),
    "vg-r101-c4-d2": TrainingConfig(),
    # fewer RoIs per image and smaller inputs than the release, so 900 steps fit in about 3 minutes on 2 cores
    SMALL_PRESET: TrainingConfig(
        rpn_pre_nms_topk=2000,
        rpn_post_nms_topk=300,
        roi_batch_size=64,
        min_sizes=(176, 192, 208, 224, 240),
        max_size=384,
    ),
}


def training_config(preset: str, **overrides) -> TrainingConfig:
    """The preset's training settings with `overrides` (fields of TrainingConfig) applied."""
    if preset not in TRAINING_PRESETS:
        raise ValueError(f"unknown detector preset {preset!r}; choose one of {sorted(TRAINING_PRESETS)}")
    fields = {f.name for f in dataclasses.fields(TrainingConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown detector training setting(s) {unknown}; valid: {sorted(fields)}")
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    return dataclasses.replace(TRAINING_PRESETS[preset], **overrides)


def preset_config(preset: str) -> DetectorConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown detector preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset]


def config_from_dict(data: dict) -> DetectorConfig:
    """A DetectorConfig from its `dataclasses.asdict` form (JSON lists back to tuples); unknown keys are
    refused by name."""
    fields = {f.name for f in dataclasses.fields(DetectorConfig)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"unknown detector config key(s) {unknown}")
    return DetectorConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def resolve_config(
    preset: str,
    selection: str = "caffe",
    min_boxes: int = 36,
    max_boxes: int = 36,
    base: DetectorConfig | None = None,
    **overrides,
) -> tuple[DetectorConfig, SelectionConfig]:
    """The preset (or `base`) with `overrides` applied; each override names a field of either config."""
    base = base if base is not None else preset_config(preset)
    det_fields = {f.name for f in dataclasses.fields(DetectorConfig)}
    sel_fields = {f.name for f in dataclasses.fields(SelectionConfig)} - {"rule", "min_boxes", "max_boxes"}
    unknown = sorted(set(overrides) - det_fields - sel_fields)
    if unknown:
        raise ValueError(f"unknown detector override(s) {unknown}; valid: {sorted(det_fields | sel_fields)}")
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    det = dataclasses.replace(base, **{k: v for k, v in overrides.items() if k in det_fields})
    sel = SelectionConfig(
        rule=selection,
        min_boxes=min_boxes,
        max_boxes=max_boxes,
        **{k: v for k, v in overrides.items() if k in sel_fields},
    )
    return det, sel
