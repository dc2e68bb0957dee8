"""What pipelines takes from `model` that `model` does not export at top level yet: the family table and
checkpoint helpers. At the issue-13 merge every `pipelines.model_api` import becomes `from model import`."""

from __future__ import annotations

from dataclasses import dataclass, field

from model import Lxmert, LxmertConfig, LxmertForNLVR2, LxmertForPreTraining, LxmertForQuestionAnswering
from model.checkpoint import CONFIG_NAME, FORMAT, read_checkpoint
from model.config import _PRESETS
from model.convert import convert_lxmert, to_hf_state

__all__ = [
    "CONFIG_NAME",
    "FAMILIES",
    "FORMAT",
    "Family",
    "convert_lxmert",
    "get_family",
    "read_checkpoint",
    "to_hf_state",
]


# the family contract gives every config class its PRESETS table; the restructured model/ defines it
LxmertConfig.PRESETS = _PRESETS


@dataclass(frozen=True)
class Family:
    """A model family: its config class and its classes by role."""

    name: str
    config_class: type
    models: dict[str, type] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "lxmert": Family(
        "lxmert",
        LxmertConfig,
        {
            "backbone": Lxmert,
            "pretraining": LxmertForPreTraining,
            "qa": LxmertForQuestionAnswering,
            "nlvr2": LxmertForNLVR2,
        },
    )
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[name]
