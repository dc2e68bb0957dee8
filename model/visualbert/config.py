"""`VisualBertConfig`: the sizes and regularisation of a VisualBERT model, with named presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..presets import PresetConfig


@dataclass
class VisualBertConfig(PresetConfig):
    """Hyper-parameters of VisualBERT; field names and defaults follow transformers' `VisualBertConfig`,
    except `visual_feat_dim` (its `visual_embedding_dim`), the store's 2048-d region features."""

    # Named configurations for `preset`: field overrides of the defaults below.
    FAMILY: ClassVar[str] = "VisualBERT"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # BERT-base with 2048-d region features (uclanlp/visualbert-vqa-coco-pre's sizes).
        "base": {},
        # Small enough for unit tests and the demo on a laptop CPU.
        "tiny": {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 128,
        },
    }

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    visual_feat_dim: int = 2048
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    # Start the visual type/position tables as copies of the text ones (as transformers does).
    special_visual_initialize: bool = True
    # The visual token type of a single image's regions: 1 as transformers feeds them; uclanlp/visualbert's
    # COCO pre-training and VQA code feed 0 (TrainVisualBERTObjective fills zeros when the data gives none),
    # so a checkpoint converted from its releases records 0 and keeps it wherever it is tuned or run.
    visual_token_type_id: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.visual_token_type_id < self.type_vocab_size:
            raise ValueError(
                f"visual_token_type_id {self.visual_token_type_id} is not a row of the "
                f"{self.type_vocab_size} token types; give 0 (uclanlp/visualbert's checkpoints) or 1 "
                "(transformers')"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}; pick sizes that divide"
            )
