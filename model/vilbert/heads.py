"""ViLBERT's heads: masked-LM and region-class prediction, alignment, and the `SimpleClassifier`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.layers.dropout import Dropout

from .config import VilbertConfig


class SimpleClassifier(nn.Module):
    """`Linear(in, hidden) -> GELU -> LN -> Linear(hidden, out)` as `logit_fc.{0,2,3}` (the release's
    `vil_prediction`, `vil_prediction_gqa` and `vil_binary_prediction`)."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, eps: float):
        super().__init__()
        self.logit_fc = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=eps), nn.Linear(hidden, out_dim)
        )

    @property
    def out_features(self) -> int:
        return self.logit_fc[3].out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logit_fc(x)


class PredictionTransform(nn.Module):
    """`LN(gelu(dense(x)))`, the first step of both prediction heads."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class LMPredictionHead(nn.Module):
    """Vocabulary logits through the word-embedding table (tied: passed at call time) plus a bias."""

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        self.transform = PredictionTransform(cfg.hidden_size, cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, x: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        return F.linear(self.transform(x), words, self.bias)


class ImagePredictionHead(nn.Module):
    """Per-region logits over the detector's `v_target_size` (1601) classes."""

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        self.transform = PredictionTransform(cfg.v_hidden_size, cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.v_hidden_size, cfg.v_target_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x))


class PreTrainingHeads(nn.Module):
    """The release's `cls`: `predictions` (MLM), `bi_seq_relationship` (alignment on the fused pooled
    output after dropout) and `imagePredictions` (masked regions)."""

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        self.predictions = LMPredictionHead(cfg)
        self.bi_seq_relationship = nn.Linear(cfg.bi_hidden_size, 2)
        self.imagePredictions = ImagePredictionHead(cfg)
        self.dropout = Dropout(cfg.classifier_dropout_prob)
