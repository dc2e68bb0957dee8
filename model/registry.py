"""Look up an LXMERT class by the architecture name recorded in checkpoints."""

from __future__ import annotations

from .lxmert import Lxmert
from .pretraining import LxmertForPreTraining
from .tasks import LxmertForNLVR2, LxmertForQuestionAnswering

MODEL_CLASSES = {
    cls.__name__: cls for cls in (Lxmert, LxmertForPreTraining, LxmertForQuestionAnswering, LxmertForNLVR2)
}


def model_class(architecture: str) -> type:
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"unknown LXMERT architecture {architecture!r}; known: {sorted(MODEL_CLASSES)}")
    return MODEL_CLASSES[architecture]
