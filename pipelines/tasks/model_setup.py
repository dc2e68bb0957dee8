"""What a task reads off a model family instead of naming it: config values set by the data, the inputs a
model's forward takes, and the pre-training objectives its labels enable."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from pipelines.data.masking import MaskingConfig


def data_overrides(config_class: type, tokenizer, **values: Any) -> dict[str, Any]:
    """Config values the data decides (`vocab_size`, special token ids, the given `values`), kept for the
    fields `config_class` has: a family without a QA head has no `num_qa_labels`, say."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    candidates = {
        "vocab_size": len(tokenizer),
        "mask_token_id": tokenizer.mask_token_id,
        "sep_token_id": tokenizer.sep_token_id,
        **values,
    }
    return {k: v for k, v in candidates.items() if k in fields and v is not None}


def forward_parameters(model_class: type[torch.nn.Module]) -> frozenset[str]:
    """The keyword arguments `model_class.forward` accepts (inputs and labels)."""
    return frozenset(inspect.signature(model_class.forward).parameters) - {"self"}


# label argument -> the MaskingConfig switch that produces it
_OBJECTIVES = {
    "matched_labels": "matched",
    "answer_labels": "qa",
    "obj_labels": "obj",
    "attr_labels": "attr",
    "feat_targets": "feat",
}


def objectives_of(model_class: type[torch.nn.Module], masking: MaskingConfig) -> MaskingConfig:
    """`masking` with the objectives the model has no label argument for switched off (no mismatched
    captions for a model without a matching head) and masked regions on where it takes them; a class
    attribute `whole_word_masking = True` asks for whole-word masking."""
    accepted = forward_parameters(model_class)
    switches = {flag: getattr(masking, flag) and label in accepted for label, flag in _OBJECTIVES.items()}
    whole = masking.whole_words or bool(getattr(model_class, "whole_word_masking", False))
    regions = "masked_regions" in accepted
    return dataclasses.replace(masking, **switches, whole_words=whole, masked_regions=regions)
