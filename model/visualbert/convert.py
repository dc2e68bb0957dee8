"""transformers VisualBERT directories (config.json + weights) into xmodal models, with a full name report.

Module names are transformers' own, so a weight maps to itself; only the backbone prefix changes
(`visual_bert.` in the task classes, none in `VisualBertModel`) and the tied masked-LM decoder
(`cls.predictions.decoder.*`) is the word table and the head's bias rather than a weight of its own.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..foreign import ConversionReport, read_weights
from ..pretrained import Checkpoint
from .config import VisualBertConfig
from .heads import VisualBertForNLVR2, VisualBertForQuestionAnswering
from .modeling import VisualBert
from .pretraining import VisualBertForPreTraining

log = logging.getLogger(__name__)

# transformers class -> ours; other transformers heads load as the backbone, their weights reported unused.
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
# Names a file may hold for another weight (the tied decoder), and non-persistent buffers older files kept.
_TIED = {
    "cls.predictions.decoder.weight": "visual_bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
_BUFFERS = ("embeddings.position_ids",)


def config_from_hf(meta: dict[str, Any], source: str) -> VisualBertConfig:
    """Our config from transformers' config.json; settings xmodal does not implement are refused."""
    if meta.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"{source}: hidden_act {meta['hidden_act']!r} is not supported (only exact gelu)")
    if meta.get("bypass_transformer", False):
        raise ValueError(f"{source}: bypass_transformer=true is not supported; use a standard VisualBERT")
    values = {k: meta[k] for k in _CONFIG_FIELDS if k in meta}
    if "visual_embedding_dim" in meta:
        values["visual_feat_dim"] = meta["visual_embedding_dim"]
    return VisualBertConfig.from_dict(values)


def from_hf_state(
    hf: dict[str, torch.Tensor], cls: type[nn.Module], source: str
) -> tuple[dict[str, torch.Tensor], ConversionReport]:
    """transformers-named weights -> ours for `cls` (one of our classes). The report's `missing` stays
    empty: that needs the model's names (`load_hf_state`)."""
    report = ConversionReport(source=source)
    in_file = "visual_bert." if any(k.startswith("visual_bert.") for k in hf) else ""
    prefix = cls.base_model_prefix
    heads = (
        {"cls.weight", "cls.bias"} if cls in (VisualBertForQuestionAnswering, VisualBertForNLVR2) else set()
    )
    if cls is VisualBertForPreTraining:
        heads = {k for k in hf if k.startswith("cls.") and k not in _TIED}
    state: dict[str, torch.Tensor] = {}
    for key, value in hf.items():
        bare: str | None = key  # the backbone name, None for a head's
        if in_file:
            bare = key[len(in_file) :] if key.startswith(in_file) else None
        if bare in _BUFFERS:
            continue
        if key in _TIED and cls is VisualBertForPreTraining:
            original = hf.get(_TIED[key])
            if original is not None and not torch.equal(original, value):
                raise ValueError(f"{source}: {key} differs from {_TIED[key]}; xmodal's decoder is tied")
            report.tied.append(key)
        elif bare is not None:
            state[prefix + bare] = value
            report.loaded.append(key)
        elif key in heads:
            state[key] = value
            report.loaded.append(key)
        else:
            report.unexpected.append(key)
    return state, report


def load_hf_state(model: nn.Module, hf: dict[str, torch.Tensor], source: str) -> ConversionReport:
    """Copy transformers-named weights into `model` and account for every name. A missing or misshapen
    backbone weight is an error; a missing head weight is reported and left initialised."""
    state, report = from_hf_state(hf, type(model), source)
    own = model.state_dict()
    by_ours = dict(zip(state, report.loaded, strict=True))
    for name in [k for k in state if k not in own or own[k].shape != state[k].shape]:
        report.loaded.remove(by_ours[name])
        report.unexpected.append(by_ours[name])
        del state[name]
    report.missing = sorted(k for k in own if k not in state)
    backbone_missing = [k for k in report.missing if k.startswith(model.base_model_prefix)]
    if backbone_missing:
        raise ValueError(f"{source}: backbone weights missing or of another shape: {backbone_missing}")
    model.load_state_dict(state, strict=False)
    return report


def _hf_meta(directory: Path) -> dict[str, Any] | None:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: give a transformers VisualBERT directory")
    meta = json.loads(config_path.read_text())
    return meta if isinstance(meta, dict) and meta.get("model_type") == "visual_bert" else None


def _weights_file(directory: Path) -> Path:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"{directory}: no model.safetensors or pytorch_model.bin found")


def _our_class(meta: dict[str, Any], hf: dict[str, torch.Tensor], source: str) -> tuple[type, dict[str, Any]]:
    cls = HF_ARCHITECTURES.get((meta.get("architectures") or ["VisualBertModel"])[0], VisualBert)
    if cls is not VisualBertForQuestionAnswering:
        return cls, {}
    if "cls.weight" not in hf:
        raise ValueError(f"{source}: a VisualBertForQuestionAnswering without cls.weight")
    return cls, {"num_answers": hf["cls.weight"].shape[0]}


def read_huggingface_dir(directory: Path) -> Checkpoint | None:
    """(architecture, config dict, constructor kwargs, our state dict) from a transformers VisualBERT
    directory; None when the directory holds another kind of model (the `read_foreign` of the family)."""
    meta = _hf_meta(directory)
    if meta is None:
        return None
    cfg = config_from_hf(meta, str(directory / "config.json"))
    hf = read_weights(_weights_file(directory))
    cls, kwargs = _our_class(meta, hf, str(directory))
    state, report = from_hf_state(hf, cls, str(directory))
    if report.unexpected:
        log.warning("%s: %d weights not used: %s", directory, len(report.unexpected), report.unexpected)
    return cls.__name__, cfg.to_dict(), kwargs, state


def read_hf_dir(directory: str | Path) -> tuple[nn.Module, ConversionReport]:
    """Our model of the directory's architecture (the backbone for other transformers heads), loaded."""
    directory = Path(directory)
    meta = _hf_meta(directory)
    if meta is None:
        raise ValueError(f"{directory / 'config.json'}: model_type is not a transformers VisualBERT's")
    cfg = config_from_hf(meta, str(directory / "config.json"))
    hf = read_weights(_weights_file(directory))
    cls, kwargs = _our_class(meta, hf, str(directory))
    model = cls(cfg, **kwargs)
    return model, load_hf_state(model, hf, str(directory))


def convert_visualbert(src: str | Path, dst_dir: str | Path) -> Path:
    """A transformers VisualBERT directory (`uclanlp/visualbert-vqa-coco-pre`, say) -> an xmodal directory.
    Every weight name is accounted for in the log (loaded, tied, missing, unused)."""
    src, dst = Path(src), Path(dst_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory: give a transformers VisualBERT directory")
    model, report = read_hf_dir(src)
    report.log()
    model.save_pretrained(dst)
    log.info("converted %s (%s) -> %s", src, type(model).__name__, dst)
    return dst
