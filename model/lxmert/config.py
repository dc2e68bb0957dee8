"""`LxmertConfig`: the sizes and regularisation of an LXMERT model, with named presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..presets import PresetConfig


@dataclass
class LxmertConfig(PresetConfig):
    """Hyper-parameters of LXMERT; defaults are the released base model (SPEC §2)."""

    # Named configurations for `preset`: field overrides of the defaults below.
    FAMILY: ClassVar[str] = "LXMERT"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # The released model: BERT-base sizes, 9 language / 5 object / 5 cross layers, 9500 answers.
        "base": {},
        # Small enough for unit tests and the demo on a laptop CPU. BERT's init std 0.02 is set for width
        # 768 (a projection's gain std * sqrt(width) ~ 0.55); kept at width 64 every projection shrank its
        # input ~6x, attention stayed uniform and the demo's "is the (shape) on the left or the right"
        # collapsed to its prior: the same gain at width 64 is std 0.02 * sqrt(768 / 64) ~ 0.07.
        "tiny": {
            "hidden_size": 64,
            "num_attention_heads": 2,
            "intermediate_size": 128,
            "l_layers": 2,
            "r_layers": 1,
            "x_layers": 1,
            "initializer_range": 0.07,
        },
    }

    vocab_size: int = 30522
    hidden_size: int = 768
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    l_layers: int = 9
    r_layers: int = 5
    x_layers: int = 5
    visual_feat_dim: int = 2048
    visual_pos_dim: int = 4
    num_object_labels: int = 1600
    num_attr_labels: int = 400
    num_qa_labels: int = 9500
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    visual_loss_scale: float = 1 / 0.15

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                f"{self.num_attention_heads}; pick sizes that divide"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
