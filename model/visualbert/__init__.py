"""VisualBERT: text and region features in one BERT (Li et al. 2019), as transformers implements it."""

from .config import VisualBertConfig
from .convert import convert_visualbert, read_huggingface_dir
from .heads import VisualBertForNLVR2, VisualBertForQuestionAnswering
from .modeling import VisualBert, VisualBertOutput
from .pretraining import VisualBertForPreTraining, VisualBertPreTrainingOutput

__all__ = [
    "VisualBert",
    "VisualBertConfig",
    "VisualBertForNLVR2",
    "VisualBertForPreTraining",
    "VisualBertForQuestionAnswering",
    "VisualBertOutput",
    "VisualBertPreTrainingOutput",
    "convert_visualbert",
    "read_huggingface_dir",
]
