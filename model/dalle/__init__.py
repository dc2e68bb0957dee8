"""DALL-E: a discrete VAE image tokenizer and one transformer over text and image tokens."""

from .config import DalleConfig, DVAEConfig
from .dvae import DiscreteVAE, DVAEOutput, cosine_anneal, gumbel_softmax, logit_laplace_nll
from .masks import MASK_KINDS, attention_mask, layer_mask_kinds
from .transformer import DalleLoss, DalleOutput, DalleTransformer, sample_token

__all__ = [
    "MASK_KINDS",
    "DVAEConfig",
    "DVAEOutput",
    "DalleConfig",
    "DalleLoss",
    "DalleOutput",
    "DalleTransformer",
    "DiscreteVAE",
    "attention_mask",
    "cosine_anneal",
    "gumbel_softmax",
    "layer_mask_kinds",
    "logit_laplace_nll",
    "sample_token",
]
