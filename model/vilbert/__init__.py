"""ViLBERT: a text BERT and a visual stream joined by co-attention layers (vilbert-multi-task layout)."""

from .config import VilbertConfig
from .finetuning import (
    ClassificationOutput,
    VilbertForNLVR2,
    VilbertForQuestionAnswering,
    VilbertForRetrieval,
)
from .modeling import Vilbert, VilbertOutput
from .pretraining import VilbertForPreTraining, VilbertPreTrainingOutput

MODEL_CLASSES = {
    cls.__name__: cls
    for cls in (
        Vilbert,
        VilbertForPreTraining,
        VilbertForQuestionAnswering,
        VilbertForNLVR2,
        VilbertForRetrieval,
    )
}

__all__ = [
    "MODEL_CLASSES",
    "ClassificationOutput",
    "Vilbert",
    "VilbertConfig",
    "VilbertForNLVR2",
    "VilbertForPreTraining",
    "VilbertForQuestionAnswering",
    "VilbertForRetrieval",
    "VilbertOutput",
    "VilbertPreTrainingOutput",
]
