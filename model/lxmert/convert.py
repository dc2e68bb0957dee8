"""Checkpoint conversion: the original LXMERT release and HuggingFace layouts to xmodal's, and back.

HuggingFace names (473 keys for `LxmertForPreTraining`) map one-to-one onto ours, except that a fused
`qkv` projection is the concatenation of HF's `query`, `key` and `value`, and the tied MLM decoder is the
word-embedding matrix itself. Both directions copy values exactly.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..files import read_json, regular_file
from ..pretrained import Checkpoint, load_weights, read_checkpoint
from .config import LxmertConfig
from .finetuning import LxmertForNLVR2, LxmertForQuestionAnswering
from .modeling import Lxmert
from .pretraining import LxmertForPreTraining

log = logging.getLogger(__name__)

_CLASSES = {
    cls.__name__: cls for cls in (Lxmert, LxmertForPreTraining, LxmertForQuestionAnswering, LxmertForNLVR2)
}

# xmodal class name <-> HuggingFace class name; NLVR2 has no HuggingFace class.
HF_ARCHITECTURES = {
    "Lxmert": "LxmertModel",
    "LxmertForPreTraining": "LxmertForPreTraining",
    "LxmertForQuestionAnswering": "LxmertForQuestionAnswering",
}
_HF_CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "l_layers",
    "r_layers",
    "x_layers",
    "visual_feat_dim",
    "visual_pos_dim",
    "num_object_labels",
    "num_attr_labels",
    "num_qa_labels",
    "max_position_embeddings",
    "type_vocab_size",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "initializer_range",
)
# HF keys that duplicate another key (tied weights): (alias, original).
_TIED = (
    ("cls.predictions.decoder.weight", "lxmert.embeddings.word_embeddings.weight"),
    ("cls.predictions.decoder.bias", "cls.predictions.bias"),
)

Pairs = list[tuple[str, list[str]]]


def _param(ours: str, hf: str) -> Pairs:
    return [(f"{ours}.weight", [f"{hf}.weight"]), (f"{ours}.bias", [f"{hf}.bias"])]


def _attention(ours: str, hf_qkv: str, hf_out: str) -> Pairs:
    qkv = [
        (f"{ours}.qkv.{p}", [f"{hf_qkv}.{n}.{p}" for n in ("query", "key", "value")])
        for p in ("weight", "bias")
    ]
    return qkv + _param(f"{ours}.out", f"{hf_out}.dense") + _param(f"{ours}.norm", f"{hf_out}.LayerNorm")


def _ffn(ours: str, hf_inter: str, hf_out: str) -> Pairs:
    return (
        _param(f"{ours}.up", f"{hf_inter}.dense")
        + _param(f"{ours}.down", f"{hf_out}.dense")
        + _param(f"{ours}.norm", f"{hf_out}.LayerNorm")
    )


def _backbone_pairs(cfg: LxmertConfig) -> Pairs:
    pairs: Pairs = [
        ("embeddings.word.weight", ["embeddings.word_embeddings.weight"]),
        ("embeddings.position.weight", ["embeddings.position_embeddings.weight"]),
        ("embeddings.token_type.weight", ["embeddings.token_type_embeddings.weight"]),
        *_param("embeddings.norm", "embeddings.LayerNorm"),
        *_param("object_embeddings.feat_proj", "encoder.visn_fc.visn_fc"),
        *_param("object_embeddings.feat_norm", "encoder.visn_fc.visn_layer_norm"),
        *_param("object_embeddings.box_proj", "encoder.visn_fc.box_fc"),
        *_param("object_embeddings.box_norm", "encoder.visn_fc.box_layer_norm"),
    ]
    for ours, hf, n in (("lang_layers", "layer", cfg.l_layers), ("object_layers", "r_layers", cfg.r_layers)):
        for i in range(n):
            o, h = f"{ours}.{i}", f"encoder.{hf}.{i}"
            pairs += _attention(f"{o}.attention", f"{h}.attention.self", f"{h}.attention.output")
            pairs += _ffn(f"{o}.ffn", f"{h}.intermediate", f"{h}.output")
    for i in range(cfg.x_layers):
        o, h = f"cross_layers.{i}", f"encoder.x_layers.{i}"
        pairs += _attention(
            f"{o}.cross_attention", f"{h}.visual_attention.att", f"{h}.visual_attention.output"
        )
        pairs += _attention(f"{o}.lang_attention", f"{h}.lang_self_att.self", f"{h}.lang_self_att.output")
        pairs += _attention(f"{o}.vision_attention", f"{h}.visn_self_att.self", f"{h}.visn_self_att.output")
        pairs += _ffn(f"{o}.lang_ffn", f"{h}.lang_inter", f"{h}.lang_output")
        pairs += _ffn(f"{o}.vision_ffn", f"{h}.visn_inter", f"{h}.visn_output")
    return pairs + _param("pooler.dense", "pooler.dense")


def _classifier(ours: str, hf: str) -> Pairs:
    return (
        _param(f"{ours}.dense", f"{hf}.0")
        + _param(f"{ours}.norm", f"{hf}.2")
        + _param(f"{ours}.classifier", f"{hf}.3")
    )


def name_pairs(cfg: LxmertConfig, architecture: str) -> Pairs:
    """(our key, HF keys it is the concatenation of) for every parameter of `architecture`."""
    prefix = _prefix(architecture)
    pairs = [(prefix + o, [prefix + h for h in hs]) for o, hs in _backbone_pairs(cfg)]
    if architecture == "LxmertForPreTraining":
        pairs += [("mlm_head.bias", ["cls.predictions.bias"])]
        pairs += _param("mlm_head.transform.dense", "cls.predictions.transform.dense")
        pairs += _param("mlm_head.transform.norm", "cls.predictions.transform.LayerNorm")
        pairs += _param("match_head", "cls.seq_relationship")
        pairs += _param("object_head.transform.dense", "obj_predict_head.transform.dense")
        pairs += _param("object_head.transform.norm", "obj_predict_head.transform.LayerNorm")
        for name in ("obj", "attr", "feat"):
            pairs += _param(f"object_head.{name}", f"obj_predict_head.decoder_dict.{name}")
        pairs += _classifier("qa_head", "answer_head.logit_fc")
    elif architecture == "LxmertForQuestionAnswering":
        pairs += _classifier("answer_head", "answer_head.logit_fc")
    elif architecture == "LxmertForNLVR2":
        pairs += _classifier("pair_head", "answer_head.logit_fc")
    return pairs


def _lxmert_class(architecture: str) -> type:
    if architecture not in _CLASSES:
        raise ValueError(f"{architecture!r} is not an LXMERT class; known: {sorted(_CLASSES)}")
    return _CLASSES[architecture]


def _prefix(architecture: str) -> str:
    """Where the backbone sits in `architecture`'s keys; HuggingFace nests it the same way."""
    return _lxmert_class(architecture).base_model_prefix


def from_hf_state(
    hf: dict[str, torch.Tensor], cfg: LxmertConfig, architecture: str, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """HF-named state dict -> ours. Missing and unknown keys are reported by name; a missing backbone
    key is an error, a missing head key leaves that head to be initialised."""
    ours: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    used: set[str] = set()
    for o, hs in name_pairs(cfg, architecture):
        absent = [h for h in hs if h not in hf]
        if absent:
            missing += absent
            continue
        ours[o] = hf[hs[0]] if len(hs) == 1 else torch.cat([hf[h] for h in hs], dim=0)
        used.update(hs)
    prefix = _prefix(architecture)
    for alias, original in _TIED:
        alias, original = alias.replace("lxmert.", prefix), original.replace("lxmert.", prefix)
        if alias in hf and original in hf:
            used.add(alias)
            if not torch.equal(hf[alias], hf[original]):
                log.warning(
                    "%s: %s differs from %s; xmodal ties them and keeps %s", source, alias, original, original
                )
    unknown = sorted(set(hf) - used)
    backbone_missing = [k for k in missing if k.startswith(prefix)]
    if backbone_missing:
        raise ValueError(f"{source}: backbone weights missing: {backbone_missing}")
    if missing:
        log.warning(
            "%s: %d head weights missing, those heads will be initialised: %s", source, len(missing), missing
        )
    if unknown:
        log.warning("%s: %d unknown weights ignored: %s", source, len(unknown), unknown)
    return ours


def to_hf_state(
    ours: dict[str, torch.Tensor], cfg: LxmertConfig, architecture: str
) -> dict[str, torch.Tensor]:
    """Our state dict -> HF names (with the tied MLM decoder written out, as HF's own files have it)."""
    hf: dict[str, torch.Tensor] = {}
    for o, hs in name_pairs(cfg, architecture):
        if o not in ours:
            raise ValueError(f"state dict lacks {o!r}: is it a {architecture}?")
        for h, part in zip(hs, ours[o].chunk(len(hs), dim=0), strict=True):
            hf[h] = part.contiguous()
    if architecture == "LxmertForPreTraining":
        hf["cls.predictions.decoder.weight"] = hf["lxmert.embeddings.word_embeddings.weight"].clone()
    return hf


def read_huggingface_dir(directory: Path) -> Checkpoint | None:
    """(xmodal architecture, config dict, constructor kwargs, our state dict) from a HuggingFace LXMERT
    directory; None when `directory` holds another kind of model."""
    meta = read_json(directory / "config.json", "model config")
    if not isinstance(meta, dict) or meta.get("model_type") != "lxmert":
        return None
    act = meta.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(
            f"{directory}/config.json: hidden_act {act!r} is not supported (LXMERT uses exact gelu)"
        )
    values = {k: meta[k] for k in _HF_CONFIG_FIELDS if k in meta}
    if "visual_loss_normalizer" in meta:
        values["visual_loss_scale"] = meta["visual_loss_normalizer"]
    cfg = LxmertConfig.from_dict(values, where=f"{directory / 'config.json'}")
    hf = _load_hf_weights(directory)
    hf_arch = (meta.get("architectures") or [None])[0]
    by_hf = {v: k for k, v in HF_ARCHITECTURES.items()}
    architecture = by_hf.get(hf_arch) or _guess_architecture(hf, cfg, str(directory))[0]
    kwargs = {"num_answers": cfg.num_qa_labels} if architecture == "LxmertForQuestionAnswering" else {}
    return architecture, cfg.to_dict(), kwargs, from_hf_state(hf, cfg, architecture, source=str(directory))


def _load_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).is_file():
            return _load_file(directory / name)
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / name
        if index.is_file():
            data = read_json(index, "sharded index")
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError(f"{index}: no weight_map naming the shard of each weight")
            shards = sorted(set(weight_map.values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(_load_file(directory / shard))
            return state
    raise FileNotFoundError(
        f"{directory}: no model.safetensors or pytorch_model.bin (or sharded index) found"
    )


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    regular_file(path, "weights")
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


def release_to_hf_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original-release names (`module.`, `bert.`, `lxrt_encoder.model.bert.`, `logit_fc.`) -> HF names."""
    out = {}
    for key, value in state.items():
        key = ".".join(part for part in key.split(".") if part != "module")
        key = re.sub(r"^(lxrt_encoder\.model\.)?bert\.", "lxmert.", key)
        key = re.sub(r"^logit_fc\.", "answer_head.logit_fc.", key)
        out[key] = value
    return out


def _guess_architecture(
    hf: dict[str, torch.Tensor], cfg: LxmertConfig, source: str
) -> tuple[str, dict[str, Any]]:
    if "cls.predictions.bias" in hf:
        return "LxmertForPreTraining", {}
    head = hf.get("answer_head.logit_fc.0.weight")
    if head is None:
        return "Lxmert", {}
    if head.shape[1] == 2 * cfg.hidden_size:
        return "LxmertForNLVR2", {}
    if "answer_head.logit_fc.3.weight" not in hf:
        raise ValueError(f"{source}: the answer head lacks its output layer (answer_head.logit_fc.3.weight)")
    return "LxmertForQuestionAnswering", {"num_answers": hf["answer_head.logit_fc.3.weight"].shape[0]}


def infer_config(hf: dict[str, torch.Tensor], num_attention_heads: int | None = None) -> LxmertConfig:
    """Sizes read off a HF-named state dict that came without a config (the release files)."""

    def count(pattern: str) -> int:
        return len({m.group(1) for k in hf if (m := re.match(pattern, k))})

    word = hf["lxmert.embeddings.word_embeddings.weight"]
    hidden = word.shape[1]
    values: dict[str, Any] = {
        "vocab_size": word.shape[0],
        "hidden_size": hidden,
        "num_attention_heads": num_attention_heads or max(hidden // 64, 1),
        "intermediate_size": hf["lxmert.encoder.layer.0.intermediate.dense.weight"].shape[0],
        "l_layers": count(r"lxmert\.encoder\.layer\.(\d+)\."),
        "r_layers": count(r"lxmert\.encoder\.r_layers\.(\d+)\."),
        "x_layers": count(r"lxmert\.encoder\.x_layers\.(\d+)\."),
        "max_position_embeddings": hf["lxmert.embeddings.position_embeddings.weight"].shape[0],
        "type_vocab_size": hf["lxmert.embeddings.token_type_embeddings.weight"].shape[0],
        "visual_feat_dim": hf["lxmert.encoder.visn_fc.visn_fc.weight"].shape[1],
        "visual_pos_dim": hf["lxmert.encoder.visn_fc.box_fc.weight"].shape[1],
    }
    for field, key in (
        ("num_object_labels", "obj_predict_head.decoder_dict.obj.weight"),
        ("num_attr_labels", "obj_predict_head.decoder_dict.attr.weight"),
    ):
        if key in hf:
            values[field] = hf[key].shape[0]
    if "cls.predictions.bias" in hf and "answer_head.logit_fc.3.weight" in hf:
        values["num_qa_labels"] = hf["answer_head.logit_fc.3.weight"].shape[0]
    return LxmertConfig.from_dict(values)


def read_release_file(
    path: Path, num_attention_heads: int | None = None
) -> tuple[str, LxmertConfig, dict[str, Any], dict[str, torch.Tensor]]:
    """(architecture, config, constructor kwargs, our state dict) from a release `.pth` or HF-named file."""
    hf = release_to_hf_names(_load_file(path))
    if "lxmert.embeddings.word_embeddings.weight" not in hf:
        raise ValueError(
            f"{path}: no LXMERT backbone found (expected keys like bert.embeddings.word_embeddings.weight); "
            f"first keys: {sorted(hf)[:5]}"
        )
    try:
        cfg = infer_config(hf, num_attention_heads)
    except KeyError as err:
        raise ValueError(f"{path}: incomplete LXMERT backbone, {err.args[0]} is missing") from err
    architecture, kwargs = _guess_architecture(hf, cfg, str(path))
    if architecture == "Lxmert":
        # a file without heads, as the release's `LXRTEncoder.save` writes (`bert.*` only): HF's bare
        # LxmertModel names its weights without the `lxmert.` nesting
        hf = {k.removeprefix("lxmert."): v for k, v in hf.items()}
    return architecture, cfg, kwargs, from_hf_state(hf, cfg, architecture, source=str(path))


def _answer_rows(model: torch.nn.Module) -> int | None:
    """Rows of the model's QA output layer (pre-training `qa_head`, fine-tuned `answer_head`), if any."""
    for name in ("qa_head", "answer_head"):
        head = getattr(model, name, None)
        if head is not None:
            return head.classifier.out_features
    return None


def convert_lxmert(
    src: str | Path,
    dst_dir: str | Path,
    to_hf: bool = False,
    num_attention_heads: int | None = None,
    num_answers: int | None = None,
) -> Path:
    """Convert `src` into an xmodal directory at `dst_dir`, or with `to_hf` into a HuggingFace directory.

    `src`: a release file (`Epoch20_LXRT.pth`, `model_LXRT.pth`, `BEST.pth`, or the encoder alone as
    `LXRTEncoder.save` writes it, `<name>_LXRT.pth` with `bert.*` keys), a HuggingFace directory, or
    an xmodal directory. Release files carry no config: the sizes are read off the weights and the head
    count is hidden_size / 64 unless `num_attention_heads` says otherwise. `num_answers`: the size of the
    answer table meant to go with the QA head; a model without one, or with another number of rows, is
    refused before anything is written.
    """
    src, dst = Path(src), Path(dst_dir)
    if src.is_dir():
        architecture, cfg_dict, kwargs, state = read_checkpoint(src)
        if architecture not in _CLASSES:
            raise ValueError(f"{src} holds a {architecture}, not an LXMERT model: convert it with its family")
        cfg = LxmertConfig.from_dict(cfg_dict)
    elif src.is_file():
        architecture, cfg, kwargs, state = read_release_file(src, num_attention_heads)
    else:
        raise FileNotFoundError(f"{src} does not exist: give a release .pth file or a checkpoint directory")

    model = _CLASSES[architecture](cfg, **kwargs)
    load_weights(model, state, model.base_model_prefix, architecture, source=str(src))
    if num_answers is not None:
        rows = _answer_rows(model)
        if rows is None:
            raise ValueError(f"{src}: a {architecture} has no QA head for an answer table to label")
        if rows != num_answers:
            raise ValueError(
                f"{src}: the QA head has {rows} answers but the answer table {num_answers}; give the table "
                "the head was trained with (all_ans.json for Epoch20_LXRT.pth)"
            )
    if not to_hf:
        model.save_pretrained(dst)
        log.info("converted %s (%s) -> %s", src, architecture, dst)
        return dst

    if architecture not in HF_ARCHITECTURES:
        raise ValueError(f"{src}: {architecture} has no HuggingFace counterpart to export to")
    dst.mkdir(parents=True, exist_ok=True)
    hf_cfg = {
        "architectures": [HF_ARCHITECTURES[architecture]],
        "model_type": "lxmert",
        "hidden_act": "gelu",
        **{k: getattr(cfg, k) for k in _HF_CONFIG_FIELDS},
        "visual_loss_normalizer": cfg.visual_loss_scale,
    }
    if architecture == "LxmertForQuestionAnswering":
        hf_cfg["num_qa_labels"] = model.num_answers
    (dst / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    hf = to_hf_state(model.state_dict(), cfg, architecture)
    save_file(hf, str(dst / "model.safetensors"), metadata={"format": "pt"})
    log.info("exported %s (%s) -> HuggingFace %s", src, architecture, dst)
    return dst
