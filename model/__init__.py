"""LXMERT: language, object-relationship and cross-modality encoders with their heads."""

from .config import LxmertConfig
from .lxmert import Lxmert, LxmertOutput
from .pretraining import LxmertForPreTraining, PreTrainingOutput
from .tasks import ClassificationOutput, LxmertForNLVR2, LxmertForQuestionAnswering

__all__ = [
    "ClassificationOutput",
    "Lxmert",
    "LxmertConfig",
    "LxmertForNLVR2",
    "LxmertForPreTraining",
    "LxmertForQuestionAnswering",
    "LxmertOutput",
    "PreTrainingOutput",
]
