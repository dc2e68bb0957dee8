"""The model families: config, classes by role, checkpoint conversion and foreign readers of each.

This is the only module that knows the families. A new family is one folder (`model/<family>/`) plus one
row in `FAMILIES`; roles are built as `models["qa"](config, num_answers=A)`, `models[role](config)` else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import pretrained
from .captioning import CaptionConfig, HardAttentionCaptioner, SoftAttentionCaptioner, UpDownCaptioner
from .dalle import DalleConfig, DalleTransformer, DiscreteVAE, DVAEConfig
from .lxmert import (
    Lxmert,
    LxmertConfig,
    LxmertForNLVR2,
    LxmertForPreTraining,
    LxmertForQuestionAnswering,
    LxmertForRetrieval,
    convert_lxmert,
    read_huggingface_dir,
)
from .pretrained import CONFIG_NAME, Checkpoint
from .vilbert import (
    Vilbert,
    VilbertConfig,
    VilbertForNLVR2,
    VilbertForPreTraining,
    VilbertForQuestionAnswering,
    VilbertForRetrieval,
    convert_vilbert,
)
from .visualbert import (
    VisualBert,
    VisualBertConfig,
    VisualBertForNLVR2,
    VisualBertForPreTraining,
    VisualBertForQuestionAnswering,
    convert_visualbert,
)
from .visualbert import read_huggingface_dir as read_visualbert_dir
from .vlbert import (
    VlBert,
    VlBertConfig,
    VlBertForNLVR2,
    VlBertForPreTraining,
    VlBertForQuestionAnswering,
    convert_vlbert,
)


@dataclass(frozen=True)
class Family:
    """One model family. `config_class` has `PRESETS`, `preset(name, **overrides)`, `from_dict`, `to_dict`;
    `models` maps a role ("backbone", "pretraining", "qa", "nlvr2", ...) to its class; `convert(src, dst,
    ...)` writes an xmodal directory from the family's released checkpoints; `read_foreign(directory)`
    reads another library's directory of this family as a `Checkpoint`, or returns None when the directory
    holds something else."""

    name: str
    config_class: type
    models: Mapping[str, type]
    convert: Callable[..., Path] | None = None
    read_foreign: Callable[[Path], Checkpoint | None] | None = None


FAMILIES: dict[str, Family] = {
    "lxmert": Family(
        name="lxmert",
        config_class=LxmertConfig,
        models={
            "backbone": Lxmert,
            "pretraining": LxmertForPreTraining,
            "qa": LxmertForQuestionAnswering,
            "nlvr2": LxmertForNLVR2,
            "retrieval": LxmertForRetrieval,
        },
        convert=convert_lxmert,
        read_foreign=read_huggingface_dir,
    ),
    "vilbert": Family(
        name="vilbert",
        config_class=VilbertConfig,
        models={
            "backbone": Vilbert,
            "pretraining": VilbertForPreTraining,
            "qa": VilbertForQuestionAnswering,
            "nlvr2": VilbertForNLVR2,
            "retrieval": VilbertForRetrieval,
        },
        convert=convert_vilbert,
    ),
    "vlbert": Family(
        name="vlbert",
        config_class=VlBertConfig,
        models={
            "backbone": VlBert,
            "pretraining": VlBertForPreTraining,
            "qa": VlBertForQuestionAnswering,
            "nlvr2": VlBertForNLVR2,
        },
        convert=convert_vlbert,
    ),
    "visualbert": Family(
        name="visualbert",
        config_class=VisualBertConfig,
        models={
            "backbone": VisualBert,
            "pretraining": VisualBertForPreTraining,
            "qa": VisualBertForQuestionAnswering,
            "nlvr2": VisualBertForNLVR2,
        },
        convert=convert_visualbert,
        read_foreign=read_visualbert_dir,
    ),
    # The captioners: one row per architecture, the whole network in both roles (no separate backbone).
    "updown": Family(
        name="updown",
        config_class=CaptionConfig,
        models={"backbone": UpDownCaptioner, "caption": UpDownCaptioner},
    ),
    "sat-soft": Family(
        name="sat-soft",
        config_class=CaptionConfig,
        models={"backbone": SoftAttentionCaptioner, "caption": SoftAttentionCaptioner},
    ),
    "sat-hard": Family(
        name="sat-hard",
        config_class=CaptionConfig,
        models={"backbone": HardAttentionCaptioner, "caption": HardAttentionCaptioner},
    ),
    # DALL-E's two stages: the image tokenizer and the text-to-image-tokens transformer.
    "dalle-dvae": Family(name="dalle-dvae", config_class=DVAEConfig, models={"backbone": DiscreteVAE}),
    "dalle": Family(
        name="dalle",
        config_class=DalleConfig,
        models={"backbone": DalleTransformer, "generate": DalleTransformer},
    ),
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def _by_class_name() -> dict[str, tuple[type, Family]]:
    return {cls.__name__: (cls, family) for family in FAMILIES.values() for cls in family.models.values()}


def architecture_class(class_name: str) -> type:
    """The class a checkpoint's config.json names as its `architecture`, whatever its family."""
    return _lookup(class_name)[0]


def family_of(class_name: str) -> Family:
    return _lookup(class_name)[1]


def _lookup(class_name: str) -> tuple[type, Family]:
    known = _by_class_name()
    if class_name not in known:
        raise ValueError(f"unknown architecture {class_name!r}; known: {sorted(known)}")
    return known[class_name]


def read_foreign(directory: Path) -> Checkpoint:
    """A directory in another library's layout, read by the first family that recognises it."""
    readers = {name: family.read_foreign for name, family in FAMILIES.items() if family.read_foreign}
    for read in readers.values():
        checkpoint = read(directory)
        if checkpoint is not None:
            return checkpoint
    raise ValueError(
        f"{directory / CONFIG_NAME} is neither an xmodal config nor a foreign one of a family xmodal reads "
        f"({', '.join(sorted(readers))}); give a directory written by save_pretrained or `xmodal convert`"
    )


pretrained.install_catalogue(
    pretrained.Catalogue(
        architecture_class=architecture_class,
        family_name=lambda class_name: family_of(class_name).name,
        read_foreign=read_foreign,
    )
)
