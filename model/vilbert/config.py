"""`VilbertConfig`: sizes and co-attention placement of a ViLBERT model, with named presets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..presets import PresetConfig

FUSION_METHODS = ("mul", "sum")


@dataclass
class VilbertConfig(PresetConfig):
    """Hyper-parameters of ViLBERT; defaults are the released `bert_base_6layer_6conect` (SPEC §5).

    Co-attention layer k runs after text layers [0, t_biattention_id[k]) and visual layers
    [0, v_biattention_id[k]); the remaining layers of each stream run after the last one.
    """

    # Named configurations for `preset`: field overrides of the defaults below.
    FAMILY: ClassVar[str] = "ViLBERT"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # vilbert-multi-task's bert_base_6layer_6conect: BERT-base text stream, 6 visual layers of 1024,
        # co-attention after text layers 5..10 (t_biattention_id 6..11) and before visual layers 0..5.
        "base": {},
        # Small enough for unit tests and the demo on a laptop CPU; same placement pattern as base.
        "tiny": {
            "hidden_size": 64,
            "num_attention_heads": 2,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "v_hidden_size": 48,
            "v_num_attention_heads": 2,
            "v_intermediate_size": 96,
            "v_num_hidden_layers": 2,
            "bi_hidden_size": 32,
            "bi_num_attention_heads": 2,
            "v_biattention_id": [0, 1],
            "t_biattention_id": [2, 3],
        },
    }

    vocab_size: int = 30522
    hidden_size: int = 768
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    visual_feat_dim: int = 2048  # the release's v_feature_size
    v_hidden_size: int = 1024
    v_num_attention_heads: int = 8
    v_intermediate_size: int = 1024
    v_num_hidden_layers: int = 6
    bi_hidden_size: int = 1024
    bi_num_attention_heads: int = 8
    v_biattention_id: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4, 5])
    t_biattention_id: list[int] = field(default_factory=lambda: [6, 7, 8, 9, 10, 11])
    num_locs: int = 5
    v_target_size: int = 1601
    fusion_method: str = "mul"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    v_hidden_dropout_prob: float = 0.1
    v_attention_probs_dropout_prob: float = 0.1
    classifier_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    # vilbert-multi-task's multi_task_model.bin puts a learned task token after [CLS] (20 rows).
    task_vocab_size: int = 0
    task_token: int | None = None

    def __post_init__(self) -> None:
        for hidden, heads, name in (
            (self.hidden_size, self.num_attention_heads, "hidden_size / num_attention_heads"),
            (self.v_hidden_size, self.v_num_attention_heads, "v_hidden_size / v_num_attention_heads"),
            (self.bi_hidden_size, self.bi_num_attention_heads, "bi_hidden_size / bi_num_attention_heads"),
        ):
            if hidden % heads:
                raise ValueError(f"{name} = {hidden} / {heads} is not whole; pick sizes that divide")
        self.v_biattention_id = list(self.v_biattention_id)
        self.t_biattention_id = list(self.t_biattention_id)
        if len(self.v_biattention_id) != len(self.t_biattention_id):
            raise ValueError(
                f"v_biattention_id {self.v_biattention_id} and t_biattention_id {self.t_biattention_id} "
                "must have one entry per co-attention layer each"
            )
        for ids, layers, name in (
            (self.v_biattention_id, self.v_num_hidden_layers, "v_biattention_id"),
            (self.t_biattention_id, self.num_hidden_layers, "t_biattention_id"),
        ):
            if ids != sorted(ids) or any(not 0 <= i <= layers for i in ids):
                raise ValueError(f"{name} {ids} must be non-decreasing layer counts within 0..{layers}")
        if self.fusion_method not in FUSION_METHODS:
            raise ValueError(f"fusion_method {self.fusion_method!r}: choose one of {FUSION_METHODS}")
        if self.task_token is not None and not 0 <= self.task_token < self.task_vocab_size:
            raise ValueError(
                f"task_token {self.task_token} needs a task table with more rows (task_vocab_size "
                f"{self.task_vocab_size})"
            )

    @property
    def num_co_layers(self) -> int:
        return len(self.v_biattention_id)
