"""Typed detector and region-selection configs, and the named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

SELECTION_RULES = ("caffe", "maxnms", "threshold")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class DetectorConfig:
    """Architecture and test-time settings of the Visual Genome Faster R-CNN R101-C4."""

    min_size: int = 600
    max_size: int = 1000
    pixel_mean: tuple[float, float, float] = (102.9801, 115.9465, 122.7717)  # BGR
    pixel_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    blocks_per_stage: tuple[int, int, int] = (3, 4, 23)  # res2, res3, res4 of ResNet-101
    anchor_sizes: tuple[float, ...] = (64.0, 128.0, 256.0, 512.0)
    anchor_ratios: tuple[float, ...] = (0.5, 1.0, 2.0)
    rpn_channels: int = 512
    pre_nms_topk: int = 6000
    post_nms_topk: int = 300
    rpn_nms_thresh: float = 0.7
    pooler_resolution: int = 14
    res5_dilation: int = 2
    num_classes: int = 1600
    num_attributes: int = 400
    attr_embed_dim: int = 256
    attr_hidden_dim: int = 512
    bbox_reg_weights: tuple[float, float, float, float] = (10.0, 10.0, 5.0, 5.0)
    dtype: str = "float32"  # float16/bfloat16 autocast the convolutions on CUDA; box math stays float32

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0 < self.min_size <= self.max_size:
            raise ValueError(f"need 0 < min_size <= max_size, got {self.min_size}/{self.max_size}")
        if self.post_nms_topk < 1 or self.pre_nms_topk < 1:
            raise ValueError("pre_nms_topk and post_nms_topk must be positive")


@dataclass(frozen=True)
class SelectionConfig:
    """Which regions of the proposals are kept (see extraction/selection.py for the three rules)."""

    rule: str = "caffe"
    min_boxes: int = 36
    max_boxes: int = 36
    conf_thresh: float = 0.2  # caffe: keep proposals whose max_conf reaches this
    nms_thresh: float = 0.3  # caffe and threshold: per-class NMS IoU
    score_thresh: float = 0.2  # threshold: per-class score threshold
    maxnms_thresholds: tuple[float, ...] = field(default=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9))

    def __post_init__(self) -> None:
        if self.rule not in SELECTION_RULES:
            raise ValueError(f"selection rule must be one of {SELECTION_RULES}, got {self.rule!r}")
        if not 0 <= self.min_boxes <= self.max_boxes or self.max_boxes < 1:
            raise ValueError(
                f"need 0 <= min_boxes <= max_boxes and max_boxes >= 1; got {self.min_boxes}/{self.max_boxes}"
            )


PRESETS: dict[str, DetectorConfig] = {
    # LXMERT's extraction settings (bottom-up attention test config: 600/1000, 300 proposals)
    "vg-r101-c4": DetectorConfig(),
    # the same network at detectron2's stock test settings
    "vg-r101-c4-d2": DetectorConfig(min_size=800, max_size=1333, post_nms_topk=1000),
}


def resolve_config(
    preset: str, selection: str = "caffe", min_boxes: int = 36, max_boxes: int = 36, **overrides
) -> tuple[DetectorConfig, SelectionConfig]:
    """The preset with `overrides` applied; each override names a field of either config."""
    if preset not in PRESETS:
        raise ValueError(f"unknown detector preset {preset!r}; choose one of {sorted(PRESETS)}")
    det_fields = {f.name for f in dataclasses.fields(DetectorConfig)}
    sel_fields = {f.name for f in dataclasses.fields(SelectionConfig)} - {"rule", "min_boxes", "max_boxes"}
    unknown = sorted(set(overrides) - det_fields - sel_fields)
    if unknown:
        raise ValueError(f"unknown detector override(s) {unknown}; valid: {sorted(det_fields | sel_fields)}")
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}
    det = dataclasses.replace(PRESETS[preset], **{k: v for k, v in overrides.items() if k in det_fields})
    sel = SelectionConfig(
        rule=selection,
        min_boxes=min_boxes,
        max_boxes=max_boxes,
        **{k: v for k, v in overrides.items() if k in sel_fields},
    )
    return det, sel
