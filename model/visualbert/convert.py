"""transformers VisualBERT directories (config.json + weights) into xmodal models, with a full name report,
and xmodal VisualBERT directories back into transformers' layout.

Module names are transformers' own, so a weight maps to itself; only the backbone prefix changes
(`visual_bert.` in the task classes, none in `VisualBertModel`) and the tied masked-LM decoder
(`cls.predictions.decoder.*`) is the word table and the head's bias rather than a weight of its own.
The matching head (`cls.seq_relationship`) moves as it is, both ways: uclanlp/visualbert trained it with
label `int(is_correct)`, 1 = the caption belongs to the image (`dataloaders/coco_dataset.py` ~L194-218 sets
`flag = True` for the image's own caption; `dataloaders/bert_data_utils.py` ~L81 and ~L273 keep it as
`is_next` and label `int(is_next)`), and transformers' conversion only renamed keys, so the hub's
`uclanlp/visualbert-*-coco-pre` score "matched" at row 1, as xmodal's `matched_labels` do (whatever
transformers' docstring says of `sentence_image_labels`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ..files import read_json
from ..foreign import ConversionReport, read_weights
from ..pretrained import Checkpoint, read_checkpoint
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
# uclanlp's checkpoints as the hub names them (`uclanlp/visualbert-vqa-coco-pre`) and its cache stores them
# (`models--uclanlp--visualbert-vqa-coco-pre`)
_UCLANLP = re.compile(r"uclanlp(/|--)visualbert", re.IGNORECASE)


def config_from_hf(
    meta: dict[str, Any], source: str, visual_token_type_id: int | None = None
) -> VisualBertConfig:
    """Our config from transformers' config.json; settings xmodal does not implement are refused. The
    regions' token type is `visual_token_type_id` when given, else `release_convention`'s."""
    if meta.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"{source}: hidden_act {meta['hidden_act']!r} is not supported (only exact gelu)")
    if meta.get("bypass_transformer", False):
        raise ValueError(f"{source}: bypass_transformer=true is not supported; use a standard VisualBERT")
    values = {k: meta[k] for k in _CONFIG_FIELDS if k in meta}
    if "visual_embedding_dim" in meta:
        values["visual_feat_dim"] = meta["visual_embedding_dim"]
    if visual_token_type_id is None:
        visual_token_type_id, why = release_convention(meta, source)
        log.info("%s: regions get visual token type %d (%s)", source, visual_token_type_id, why)
    values["visual_token_type_id"] = visual_token_type_id
    return VisualBertConfig.from_dict(values)


def release_convention(meta: dict[str, Any], source: str) -> tuple[int, str]:
    """(the visual token type the checkpoint's regions were trained with, why we think so): the config's
    own `visual_token_type_id` (xmodal's exports write it); 0 for uclanlp/visualbert's releases, named so in
    the path or `_name_or_path` as the hub and its cache store them (their code feeds zeros); else 1, as
    transformers feeds. `xmodal convert visualbert --visual-token-type` says it outright."""
    if isinstance(meta.get("visual_token_type_id"), int):
        return meta["visual_token_type_id"], "its config's visual_token_type_id"
    names = (str(Path(source).resolve()), str(meta.get("_name_or_path", "")))
    if any(_UCLANLP.search(name) for name in names):
        return 0, "uclanlp/visualbert's release: its COCO pre-training and VQA code feed regions type 0"
    return 1, "transformers' convention; pass --visual-token-type 0 for a uclanlp/visualbert release"


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
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path} not found: give a transformers VisualBERT directory")
    meta = read_json(config_path, "model config")
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


def read_hf_dir(
    directory: str | Path, visual_token_type_id: int | None = None
) -> tuple[nn.Module, ConversionReport]:
    """Our model of the directory's architecture (the backbone for other transformers heads), loaded;
    `visual_token_type_id` as `config_from_hf` takes it."""
    directory = Path(directory)
    meta = _hf_meta(directory)
    if meta is None:
        raise ValueError(f"{directory / 'config.json'}: model_type is not a transformers VisualBERT's")
    cfg = config_from_hf(meta, str(directory / "config.json"), visual_token_type_id)
    hf = read_weights(_weights_file(directory))
    cls, kwargs = _our_class(meta, hf, str(directory))
    model = cls(cfg, **kwargs)
    return model, load_hf_state(model, hf, str(directory))


def convert_visualbert(
    src: str | Path,
    dst_dir: str | Path,
    to_hf: bool = False,
    num_answers: int | None = None,
    visual_token_type_id: int | None = None,
) -> Path:
    """A transformers VisualBERT directory (`uclanlp/visualbert-vqa-coco-pre`, say) -> an xmodal directory,
    every weight name accounted for in the log (loaded, tied, missing, unused); with `to_hf`, an xmodal (or
    transformers) VisualBERT directory -> transformers' layout, which its VisualBert* classes load as it is.
    `num_answers`: the size of the answer table meant to label the QA head, checked before anything is
    written. `visual_token_type_id`: the regions' token type the checkpoint was trained with, recorded in
    DST's config (default: `release_convention`'s)."""
    src, dst = Path(src), Path(dst_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory: give a VisualBERT checkpoint directory")
    if to_hf and visual_token_type_id is not None:
        raise ValueError("--visual-token-type applies to a transformers directory read in, not with --to-hf")
    model, report = (_load_any(src), None) if to_hf else read_hf_dir(src, visual_token_type_id)
    if num_answers is not None and getattr(model, "num_answers", None) != num_answers:
        rows = getattr(model, "num_answers", None)
        what = f"its QA head has {rows} answers" if rows else f"a {type(model).__name__} has no QA head"
        raise ValueError(
            f"{src}: {what}, but the answer table {num_answers}; give the table it was tuned with"
        )
    if to_hf:
        return export_hf(model, dst)
    report.log()
    model.save_pretrained(dst)
    log.info("converted %s (%s) -> %s", src, type(model).__name__, dst)
    return dst


def _load_any(src: Path) -> nn.Module:
    """Our model from an xmodal VisualBERT directory, or from a transformers one."""
    architecture, config, kwargs, state = read_checkpoint(src)
    classes = {cls.__name__: cls for cls in HF_ARCHITECTURES.values()}
    if architecture not in classes:
        raise ValueError(f"{src} holds a {architecture}, not a VisualBERT model: convert it with its family")
    model = classes[architecture](VisualBertConfig.from_dict(config), **kwargs)
    model.load_state_dict(state)
    return model


def to_hf_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights under transformers' names: its own names, plus the masked-LM decoder that
    transformers stores beside the word table it is tied to (a copy: safetensors keeps no shared tensors)."""
    state = {name: value.detach().contiguous() for name, value in model.state_dict().items()}
    if isinstance(model, VisualBertForPreTraining):
        for name, original in _TIED.items():
            state[name] = state[original].clone()
    return state


def export_hf(model: nn.Module, dst: Path) -> Path:
    """`dst` as transformers' `save_pretrained` writes a VisualBERT: config.json and model.safetensors."""
    names = {cls: name for name, cls in HF_ARCHITECTURES.items()}
    architecture = names[type(model)]
    cfg = model.config
    hf_config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": "visual_bert",
        "hidden_act": "gelu",
        "bypass_transformer": False,
        **{k: getattr(cfg, k) for k in _CONFIG_FIELDS},
        "visual_embedding_dim": cfg.visual_feat_dim,
        # transformers keeps unknown keys: a directory read back by xmodal keeps its regions' type
        "visual_token_type_id": cfg.visual_token_type_id,
    }
    if cfg.visual_token_type_id != 1:
        log.warning(
            "%s: its regions were trained as visual token type %d; transformers' VisualBert* classes feed "
            "type 1 unless given visual_token_type_ids (pass torch.full_like(visual_attention_mask, %d))",
            dst,
            cfg.visual_token_type_id,
            cfg.visual_token_type_id,
        )
    if isinstance(model, VisualBertForQuestionAnswering):
        hf_config["num_labels"] = model.num_answers
    elif isinstance(model, VisualBertForNLVR2):
        hf_config["num_labels"] = 2
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(to_hf_state(model), str(dst / "model.safetensors"), metadata={"format": "pt"})
    log.info("exported %s -> transformers %s", architecture, dst)
    return dst
