"""What every family config shares: named presets, dicts read field by field, and the ranges of the
fields the families have in common."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

from .ranges import check_fields, check_values

C = TypeVar("C", bound="PresetConfig")

# Sizes are capped where no released model comes near, so that a typo (1e9 words, a 1e7-wide layer) is
# refused before a tensor is allocated; `model_bytes` then checks the whole model against memory.
_WIDTH, _COUNT, _LAYERS = "[1, 65536]", "[1, 1048576]", "[0, 256]"
_PROB = "[0, 1)"
RANGES: dict[str, str] = {
    "vocab_size": _COUNT,
    "task_vocab_size": "[0, 1048576]",
    "hidden_size": _WIDTH,
    "v_hidden_size": _WIDTH,
    "bi_hidden_size": _WIDTH,
    "intermediate_size": _WIDTH,
    "v_intermediate_size": _WIDTH,
    "embed_size": _WIDTH,
    "attention_size": _WIDTH,
    "geometry_dim": _WIDTH,
    "visual_feat_dim": _WIDTH,
    "visual_pos_dim": "[1, 64]",
    "num_locs": "[1, 64]",
    "num_attention_heads": "[1, 1024]",
    "v_num_attention_heads": "[1, 1024]",
    "bi_num_attention_heads": "[1, 1024]",
    "num_hidden_layers": _LAYERS,
    "v_num_hidden_layers": _LAYERS,
    "l_layers": _LAYERS,
    "r_layers": _LAYERS,
    "x_layers": _LAYERS,
    "max_position_embeddings": "[1, 65536]",
    "max_length": "[1, 65536]",
    "type_vocab_size": "[1, 1024]",
    "visual_token_type_id": "[0, 1023]",
    "num_object_labels": _COUNT,
    "num_attr_labels": _COUNT,
    "num_qa_labels": "[0, 1048576]",
    "num_region_classes": _COUNT,
    "v_target_size": _COUNT,
    "v_biattention_id": ">= 0",
    "t_biattention_id": ">= 0",
    "hidden_dropout_prob": _PROB,
    "attention_probs_dropout_prob": _PROB,
    "v_hidden_dropout_prob": _PROB,
    "v_attention_probs_dropout_prob": _PROB,
    "classifier_dropout_prob": _PROB,
    "visual_dropout_prob": _PROB,
    "dropout": _PROB,
    "layer_norm_eps": "(0, 1)",
    "initializer_range": "[0, 10]",
    "visual_loss_scale": ">= 0",
    "reinforce_weight": ">= 0",
    "entropy_weight": ">= 0",
    "doubly_stochastic_weight": ">= 0",
    "baseline_decay": "[0, 1]",
    "expected_attention_prob": "[0, 1]",
    "pad_token_id": ">= 0",
    "bos_token_id": ">= 0",
    "eos_token_id": ">= 0",
    "unk_token_id": ">= 0",
    "mask_token_id": ">= 0",
    "sep_token_id": ">= 0",
    "task_token": ">= 0",
    # DALL-E's transformer (model/dalle): tokens are stored as uint16, grids hold at most 1024 per side
    "text_vocab_size": _COUNT,
    "text_length": "[2, 65536]",
    "image_vocab_size": "[2, 65536]",
    "image_grid": "[1, 1024]",
    "num_layers": _LAYERS,
    "num_heads": "[1, 1024]",
    "conv_kernel": "[1, 255]",
    "text_loss_weight": ">= 0",
    "image_loss_weight": ">= 0",
    # DALL-E's image tokenizer (model/dalle DVAEConfig): codes are stored as uint16
    "image_size": "[1, 65536]",
    "channels": "[1, 64]",
    "codebook_size": "[2, 65536]",
    "downsample": "[1, 1024]",
    "blocks_per_group": "[1, 64]",
    "temperature_start": "(0, 1000]",
    "temperature_end": "(0, 1000]",
    "temperature_anneal_steps": "[0, 1000000000]",
    "kl_weight": "[0, 1000]",
    "kl_anneal_steps": "[0, 1000000000]",
    "logit_laplace_eps": "(0, 0.5)",
    "gumbel_noise": "[0, 1]",
    "logit_scale": "(0, 1000]",
}


class PresetConfig:
    """Mixed into a family's config dataclass, which sets `PRESETS` (name -> field values) and `FAMILY`
    (how messages name it)."""

    PRESETS: ClassVar[dict[str, dict[str, Any]]]
    FAMILY: ClassVar[str]
    RANGES: ClassVar[dict[str, str]] = RANGES

    @classmethod
    def preset(cls: type[C], name: str, **overrides: Any) -> C:
        """A named configuration with any field overridden."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown {cls.FAMILY} preset {name!r}; choose one of {sorted(cls.PRESETS)}")
        return cls.from_dict({**cls.PRESETS[name], **overrides}, where=f"{cls.FAMILY} preset {name!r}")

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any], where: str | None = None) -> C:
        """Build from a dict, rejecting unknown keys by name (a typo must not pass silently) and values of
        the wrong type or range (one line naming `where`, the key and the range) before construction."""
        where = where or f"{cls.__name__}"
        if not isinstance(values, dict):
            raise ValueError(f"{where}: a model config is a mapping of fields, not {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"{where}: unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}"
            )
        check_values(cls, values, where)
        try:
            return cls(**values)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def check(self, where: str) -> None:
        """Every field against its type and range (for a config changed after construction)."""
        check_fields(self, where)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]
