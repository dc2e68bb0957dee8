"""Layers shared by the model families: padding-free attention, dropout, tied word table, heads, init."""

from .attention import MultiHeadAttention, Rows, attention_probs
from .dropout import Dropout, dropout
from .heads import ClassifierHead, Pooler
from .init import init_weights
from .tied import TiedWords

__all__ = [
    "ClassifierHead",
    "Dropout",
    "MultiHeadAttention",
    "Pooler",
    "Rows",
    "TiedWords",
    "attention_probs",
    "dropout",
    "init_weights",
]
