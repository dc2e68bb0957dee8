"""`VlBertConfig`: the sizes and regularisation of a VL-BERT model, with named presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..presets import PresetConfig


@dataclass
class VlBertConfig(PresetConfig):
    """Hyper-parameters of VL-BERT; defaults are the released base model (SPEC §5)."""

    # Named configurations for `preset`: field overrides of the defaults below.
    FAMILY: ClassVar[str] = "VL-BERT"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # VL-BERT-base on 2048-d region features (SPEC §5).
        "base": {},
        # Small enough for unit tests and the demo on a laptop CPU.
        "tiny": {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 128,
            "geometry_dim": 64,
        },
    }

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 3  # A text, B answer, C visual
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    visual_feat_dim: int = 2048
    # Sinusoids of (xc, yc, w, h): geometry_dim / 8 wavelengths per coordinate, sine and cosine.
    geometry_dim: int = 2048
    visual_dropout_prob: float = 0.1
    classifier_dropout_prob: float = 0.1
    num_region_classes: int = 1601  # the VG detector's classes, background included
    mask_token_id: int = 103  # BERT uncased [MASK] / [SEP]: the VQA answer segment is built from them
    sep_token_id: int = 102

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}; pick sizes that divide"
            )
        if self.geometry_dim % 8:
            raise ValueError(
                f"geometry_dim {self.geometry_dim} is not a multiple of 8 (4 coordinates x sin/cos)"
            )
        if self.type_vocab_size < 3:
            raise ValueError(
                f"type_vocab_size {self.type_vocab_size}: VL-BERT needs 3 (text, answer, visual)"
            )
