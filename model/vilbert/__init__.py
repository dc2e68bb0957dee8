"""ViLBERT: a text BERT and a visual stream joined by co-attention layers (vilbert-multi-task layout)."""

from .config import VilbertConfig
from .convert import ConversionReport, convert_vilbert, load_release
from .finetuning import VilbertForNLVR2, VilbertForQuestionAnswering, VilbertForRetrieval
from .modeling import Vilbert, VilbertOutput
from .pretraining import VilbertForPreTraining, VilbertPreTrainingOutput

__all__ = [
    "ConversionReport",
    "Vilbert",
    "VilbertConfig",
    "VilbertForNLVR2",
    "VilbertForPreTraining",
    "VilbertForQuestionAnswering",
    "VilbertForRetrieval",
    "VilbertOutput",
    "VilbertPreTrainingOutput",
    "convert_vilbert",
    "load_release",
]
