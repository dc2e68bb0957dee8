"""VL-BERT: words and regions in one BERT with visual feature embeddings (Su et al., ICLR 2020)."""

from .config import VlBertConfig
from .convert import convert_vlbert
from .heads import VlBertForNLVR2, VlBertForQuestionAnswering
from .modeling import VlBert, VlBertOutput
from .pretraining import VlBertForPreTraining, VlBertPreTrainingOutput

__all__ = [
    "VlBert",
    "VlBertConfig",
    "VlBertForNLVR2",
    "VlBertForPreTraining",
    "VlBertForQuestionAnswering",
    "VlBertOutput",
    "VlBertPreTrainingOutput",
    "convert_vlbert",
]
