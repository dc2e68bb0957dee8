"""Config values a run takes from its data, for the fields a family's config has."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from model.architectures import FAMILIES
from pipelines.engine import config_io


def data_overrides(config_class: type, tokenizer, **values: Any) -> dict[str, Any]:
    """Config values the data decides (`vocab_size`, special token ids, the given `values`), kept for the
    fields `config_class` has: a family without a QA head has no `num_qa_labels`, say."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    candidates = {
        "vocab_size": len(tokenizer),
        # a caption word vocabulary has neither
        "mask_token_id": getattr(tokenizer, "mask_token_id", None),
        "sep_token_id": getattr(tokenizer, "sep_token_id", None),
        **values,
    }
    return {k: v for k, v in candidates.items() if k in fields and v is not None}


def check_model_overrides(values: Mapping[str, Any]) -> None:
    """`task.model` overrides against the fields, types and ranges of the family configs, when the run's
    config is resolved (before any file is read or written); the chosen family's own cross-field checks
    follow when the model is built. ValueError on one line naming the key, the value and the range."""
    classes = tuple(dict.fromkeys(f.config_class for f in FAMILIES.values()))
    config_io.check_mapping_field(classes, values, "task.model")
