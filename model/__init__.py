"""Cross-modal networks that take tensors: model families (`model/<family>/`), shared layers, checkpoints.

`from model import Lxmert, ...` re-exports what the pipelines use; `model.architectures` lists the families.
"""

from .architectures import FAMILIES, Family, architecture_class, family_of, get_family
from .lxmert import (
    Lxmert,
    LxmertConfig,
    LxmertForNLVR2,
    LxmertForPreTraining,
    LxmertForQuestionAnswering,
    LxmertOutput,
    PreTrainingOutput,
    convert_lxmert,
    to_hf_state,
)
from .outputs import ClassificationOutput
from .pretrained import CONFIG_NAME, FORMAT, WEIGHTS_NAME, PretrainedMixin, read_checkpoint, read_config

__all__ = [
    "CONFIG_NAME",
    "FAMILIES",
    "FORMAT",
    "WEIGHTS_NAME",
    "ClassificationOutput",
    "Family",
    "Lxmert",
    "LxmertConfig",
    "LxmertForNLVR2",
    "LxmertForPreTraining",
    "LxmertForQuestionAnswering",
    "LxmertOutput",
    "PreTrainingOutput",
    "PretrainedMixin",
    "architecture_class",
    "convert_lxmert",
    "family_of",
    "get_family",
    "read_checkpoint",
    "read_config",
    "to_hf_state",
]
