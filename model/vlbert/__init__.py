"""VL-BERT: words and regions in one BERT with visual feature embeddings (Su et al., ICLR 2020)."""

from .config import VlBertConfig
from .heads import VlBertForNLVR2, VlBertForQuestionAnswering
from .modeling import VlBert, VlBertOutput
from .pretraining import VlBertForPreTraining

__all__ = [
    "VlBert",
    "VlBertConfig",
    "VlBertForNLVR2",
    "VlBertForPreTraining",
    "VlBertForQuestionAnswering",
    "VlBertOutput",
]
