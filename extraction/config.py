"""Typed detector configs and the named presets (architecture and test-time settings together)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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

    def architecture(self) -> dict:
        """The fields that decide the network's parameters, names and shapes."""
        return {name: getattr(self, name) for name in ARCHITECTURE_FIELDS}


DEFAULT_PRESET = "vg-r101-c4"

PRESETS: dict[str, DetectorConfig] = {
    # LXMERT's extraction settings (bottom-up attention test config: 600/1000, 300 proposals)
    DEFAULT_PRESET: DetectorConfig(),
    # the same network at detectron2's stock test settings
    "vg-r101-c4-d2": DetectorConfig(min_size=800, max_size=1333, post_nms_topk=1000),
}


def preset_config(preset: str) -> DetectorConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown detector preset {preset!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[preset]


def resolve_config(
    preset: str, selection: str = "caffe", min_boxes: int = 36, max_boxes: int = 36, **overrides
) -> tuple[DetectorConfig, SelectionConfig]:
    """The preset with `overrides` applied; each override names a field of either config."""
    base = preset_config(preset)
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
