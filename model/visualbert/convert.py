"""Read a transformers VisualBERT directory (config.json + weights) into an xmodal model, with a report.

Module names are transformers' own, so a weight maps to itself; only the backbone prefix changes
(`visual_bert.` in the task classes, none in `VisualBertModel`) and the tied masked-LM decoder
(`cls.predictions.decoder.*`) is the word table and the head's bias rather than a weight of its own.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from .config import VisualBertConfig
from .heads import VisualBertForNLVR2, VisualBertForQuestionAnswering
from .modeling import VisualBert
from .pretraining import VisualBertForPreTraining

log = logging.getLogger(__name__)

# transformers class -> ours; classes not listed load as the backbone, their heads reported unused.
HF_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "VisualBertModel": VisualBert,
    "VisualBertForPreTraining": VisualBertForPreTraining,
    "VisualBertForQuestionAnswering": VisualBertForQuestionAnswering,
    "VisualBertForVisualReasoning": VisualBertForNLVR2,
}
_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "layer_norm_eps",
    "initializer_range",
    "special_visual_initialize",
)
# Keys a file may hold that are another weight under a second name, or a buffer.
_TIED = {
    "cls.predictions.decoder.weight": "visual_bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
_BUFFERS = ("embeddings.position_ids",)


@dataclass
class ConversionReport:
    """What a conversion did with each weight name: every name of the file and of the model is in one list."""

    source: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # the model's, absent from the file
    unexpected: list[str] = field(default_factory=list)  # the file's, with no place in the model
    tied: list[str] = field(default_factory=list)  # the file's second names of one weight

    def log(self) -> None:
        log.info("%s: %d weights loaded", self.source, len(self.loaded))
        if self.tied:
            log.info("%s: %d tied aliases checked and dropped: %s", self.source, len(self.tied), self.tied)
        if self.missing:
            log.warning(
                "%s: %d weights missing, left as initialised: %s",
                self.source,
                len(self.missing),
                self.missing,
            )
        if self.unexpected:
            log.warning("%s: %d weights not used: %s", self.source, len(self.unexpected), self.unexpected)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file or a tensors-only torch file (`weights_only=True`; `{'state_dict': ...}` too)."""
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        reason = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        kind = "safetensors file" if path.suffix == ".safetensors" else "tensors-only checkpoint"
        raise ValueError(f"{path}: cannot be read as a {kind} ({type(err).__name__}: {reason})") from err
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state dict of tensors")
    return state


def _weights_file(directory: Path) -> Path:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"{directory}: no model.safetensors or pytorch_model.bin found")


def config_from_hf(meta: dict[str, Any], source: str) -> VisualBertConfig:
    """Our config from transformers' config.json; settings xmodal does not implement are refused."""
    if meta.get("model_type") != "visual_bert":
        raise ValueError(f"{source}: model_type {meta.get('model_type')!r} is not a transformers VisualBERT")
    if meta.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"{source}: hidden_act {meta['hidden_act']!r} is not supported (only exact gelu)")
    if meta.get("bypass_transformer", False):
        raise ValueError(f"{source}: bypass_transformer=true is not supported; use a standard VisualBERT")
    values = {k: meta[k] for k in _CONFIG_FIELDS if k in meta}
    if "visual_embedding_dim" in meta:
        values["visual_feat_dim"] = meta["visual_embedding_dim"]
    return VisualBertConfig.from_dict(values)


def load_hf_state(model: nn.Module, hf: dict[str, torch.Tensor], source: str) -> ConversionReport:
    """Copy a transformers-named state dict into `model` (any of our VisualBERT classes) and say what
    happened to every name. A missing backbone weight is an error; a missing head weight is reported."""
    report = ConversionReport(source=source)
    ours = model.state_dict()
    backbone_here = "" if isinstance(model, VisualBert) else "visual_bert."
    in_file = "visual_bert." if any(k.startswith("visual_bert.") for k in hf) else ""
    mapped: dict[str, torch.Tensor] = {}
    for key, value in hf.items():
        bare: str | None = key  # the backbone name, None for a head's
        if in_file:
            bare = key[len(in_file) :] if key.startswith(in_file) else None
        if bare in _BUFFERS:
            continue
        if key in _TIED:
            original = _TIED[key]
            if original in hf and not torch.equal(hf[original], value):
                log.warning(
                    "%s: %s differs from %s; xmodal ties them and keeps %s", source, key, original, original
                )
            report.tied.append(key)
            continue
        target = backbone_here + bare if bare is not None else key
        if target in ours and ours[target].shape == value.shape:
            mapped[target] = value
            report.loaded.append(key)
        else:
            report.unexpected.append(key)
    report.missing = sorted(k for k in ours if k not in mapped)
    backbone_missing = [k for k in report.missing if k.startswith(backbone_here)]
    if backbone_missing:
        raise ValueError(f"{source}: backbone weights missing or of another shape: {backbone_missing}")
    model.load_state_dict(mapped, strict=False)
    return report


def read_hf_dir(directory: str | Path) -> tuple[nn.Module, ConversionReport]:
    """Our model of the directory's architecture (or the backbone for other heads), weights loaded."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: give a transformers VisualBERT directory")
    meta = json.loads(config_path.read_text())
    cfg = config_from_hf(meta, str(config_path))
    hf = read_weights(_weights_file(directory))
    architecture = (meta.get("architectures") or ["VisualBertModel"])[0]
    cls = HF_ARCHITECTURES.get(architecture, VisualBert)
    if cls is VisualBertForQuestionAnswering:
        rows = hf.get("cls.weight")
        if rows is None:
            raise ValueError(f"{directory}: a VisualBertForQuestionAnswering without cls.weight")
        model: nn.Module = cls(cfg, num_answers=rows.shape[0])
    else:
        model = cls(cfg)
    report = load_hf_state(model, hf, str(directory))
    return model, report
