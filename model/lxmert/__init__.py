"""LXMERT: language, object-relationship and cross-modality encoders, their heads and conversion."""

from .config import LxmertConfig
from .convert import convert_lxmert, read_huggingface_dir, to_hf_state
from .finetuning import LxmertForNLVR2, LxmertForQuestionAnswering
from .modeling import Lxmert, LxmertOutput
from .pretraining import LxmertForPreTraining, PreTrainingOutput

__all__ = [
    "Lxmert",
    "LxmertConfig",
    "LxmertForNLVR2",
    "LxmertForPreTraining",
    "LxmertForQuestionAnswering",
    "LxmertOutput",
    "PreTrainingOutput",
    "convert_lxmert",
    "read_huggingface_dir",
    "to_hf_state",
]
