"""Config values a run takes from its data, for the fields a family's config has."""

from __future__ import annotations

import dataclasses
from typing import Any


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
