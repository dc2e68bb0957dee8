"""`CaptionConfig`: the sizes and training terms of the attention captioners, with named presets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..presets import PresetConfig


@dataclass
class CaptionConfig(PresetConfig):
    """Hyper-parameters shared by the Up-Down and Show-Attend-Tell captioners (SPEC §5)."""

    # Named configurations for `preset`: field overrides of the defaults below.
    FAMILY: ClassVar[str] = "captioning"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # Anderson et al. 2018: hidden 1000, attention 512, word embedding 1000 over 2048-d regions.
        "updown": {},
        # What fine-tuning builds without --init or --preset: the Up-Down paper's sizes, for every arch.
        "base": {},
        # Show, Attend and Tell over the same regions: an LSTM of 1000 and a 512-d word embedding.
        "sat": {"embed_size": 512},
        # Small enough for unit tests and the demo on a laptop CPU.
        "tiny": {
            "embed_size": 32,
            "hidden_size": 48,
            "attention_size": 24,
            "dropout": 0.0,
        },
    }

    vocab_size: int = 10000
    visual_feat_dim: int = 2048
    embed_size: int = 1000
    hidden_size: int = 1000
    attention_size: int = 512
    dropout: float = 0.5
    # Layer-normalise each region's features (no parameters) before use: detectors differ in feature scale
    # by orders of magnitude and raw 2048-d inputs saturate the LSTM gates. False = the papers' raw features.
    normalize_features: bool = True
    max_length: int = 16
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    unk_token_id: int | None = 3  # kept out of decoded captions unless asked (None: the vocabulary has none)
    # Show, Attend and Tell only: soft attention's regulariser λ, hard attention's REINFORCE terms.
    doubly_stochastic_weight: float = 1.0
    reinforce_weight: float = 1.0
    entropy_weight: float = 0.01
    baseline_decay: float = 0.9
    expected_attention_prob: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout {self.dropout} must lie in [0, 1)")
        if self.max_length < 1:
            raise ValueError(f"max_length {self.max_length} must be at least 1")
        specials = {self.pad_token_id, self.bos_token_id, self.eos_token_id}
        if len(specials) != 3 or max(specials) >= self.vocab_size or min(specials) < 0:
            raise ValueError(
                f"pad/bos/eos ids {self.pad_token_id}/{self.bos_token_id}/{self.eos_token_id} must be "
                f"distinct ids below vocab_size {self.vocab_size}"
            )
        if self.unk_token_id is not None and (
            self.unk_token_id in specials or not 0 <= self.unk_token_id < self.vocab_size
        ):
            raise ValueError(
                f"unk id {self.unk_token_id} must be an id below vocab_size {self.vocab_size} other than "
                "pad/bos/eos (or None)"
            )
