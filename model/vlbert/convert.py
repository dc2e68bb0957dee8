"""Read a jackroos/VL-BERT release checkpoint (`{'state_dict'}`, `module.*` keys) into an xmodal model.

The release keeps the backbone under `module.vlbert.*`, the visual feature embedding in its Fast R-CNN
module (`module.image_feature_extractor.obj_downsample.1`), the [IMG] word beside it
(`module.object_linguistic_embeddings`), the pre-training heads inside `vlbert` and the VQA classifier at
`module.final_mlp`. xmodal keeps the same names, with the visual embedding moved into the backbone and
the heads beside it. The ResNet of the end-to-end detector has no place here (xmodal reads stored
region features); its weights, like any other unused name, are listed in the report. The release's
region-class head puts the background class first; its rows are rotated to the store's order, background
last, so a converted head and the store's `class_probs` name the same class by the same index.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from torch import nn

from ..foreign import ConversionReport, read_weights
from ..row_order import background_last
from .config import VlBertConfig
from .heads import VlBertForNLVR2, VlBertForQuestionAnswering
from .modeling import VlBert
from .pretraining import VlBertForPreTraining

log = logging.getLogger(__name__)

# (release prefix after `module.`, ours in a head class); first match wins.
_RENAMES = (
    ("vlbert.mlm_head.", "mlm_head."),
    ("vlbert.mvrc_head.", "mvrc_head."),
    ("vlbert.", "vlbert."),
    ("image_feature_extractor.obj_downsample.", "vlbert.obj_downsample."),
    ("object_linguistic_embeddings.", "vlbert.object_linguistic_embeddings."),
    ("object_mask_visual_embedding.", "object_mask_visual_embedding."),
    ("object_mask_word_embedding.", "object_mask_word_embedding."),
    ("final_mlp.", "final_mlp."),
)
# The release's second name of the word table: BERT's tied MLM decoder.
_TIED = {"vlbert.mlm_head.predictions.decoder.weight": "vlbert.word_embeddings.weight"}
_REGION_CLASSES = ("mvrc_head.region_cls_pred.weight", "mvrc_head.region_cls_pred.bias")


def our_name(release_key: str, backbone_only: bool) -> str | None:
    """Our name for a release key (with or without `module.`), None where it has no counterpart."""
    key = release_key.removeprefix("module.")
    for theirs, ours in _RENAMES:
        if key.startswith(theirs):
            name = ours + key[len(theirs) :]
            if backbone_only:
                return name.removeprefix("vlbert.") if name.startswith("vlbert.") else None
            return name
    return None


def load_release_state(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> ConversionReport:
    """Copy release-named weights into `model` (any of our VL-BERT classes) and account for every name.
    A missing backbone weight is an error; a missing head weight is reported and left initialised."""
    report = ConversionReport(source=source)
    backbone_only = isinstance(model, VlBert)
    ours = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    bare = {k.removeprefix("module."): v for k, v in state.items()}
    for key, value in state.items():
        plain = key.removeprefix("module.")
        if plain in _TIED:
            original = bare.get(_TIED[plain])
            if original is not None and not torch.equal(original, value):
                raise ValueError(f"{source}: {key} is not the word table; the MLM decoder must be tied")
            report.tied.append(key)
            continue
        name = our_name(key, backbone_only)
        if name is not None and name in ours and ours[name].shape == value.shape:
            mapped[name] = background_last(value) if name in _REGION_CLASSES else value
            report.loaded.append(key)
        else:
            report.unexpected.append(key)
    report.missing = sorted(k for k in ours if k not in mapped)
    prefix = "" if backbone_only else "vlbert."
    backbone_missing = [k for k in report.missing if k.startswith(prefix)]
    if backbone_missing:
        raise ValueError(f"{source}: backbone weights missing or of another shape: {backbone_missing}")
    model.load_state_dict(mapped, strict=False)
    return report


def infer_config(state: dict[str, torch.Tensor], num_attention_heads: int | None = None) -> VlBertConfig:
    """Sizes read off the release weights (the heads count is not stored: hidden / 64 unless given)."""
    bare = {k.removeprefix("module."): v for k, v in state.items()}
    word = bare["vlbert.word_embeddings.weight"]
    hidden = word.shape[1]
    layers = {m.group(1) for k in bare if (m := re.match(r"vlbert\.encoder\.layer\.(\d+)\.", k))}
    downsample = bare["image_feature_extractor.obj_downsample.1.weight"]
    visual_feat_dim = 2048
    values = {
        "vocab_size": word.shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": len(layers),
        "num_attention_heads": num_attention_heads or max(hidden // 64, 1),
        "intermediate_size": bare["vlbert.encoder.layer.0.intermediate.dense.weight"].shape[0],
        "max_position_embeddings": bare["vlbert.position_embeddings.weight"].shape[0],
        "type_vocab_size": bare["vlbert.token_type_embeddings.weight"].shape[0],
        "visual_feat_dim": visual_feat_dim,
        "geometry_dim": downsample.shape[1] - visual_feat_dim,
    }
    if "vlbert.mvrc_head.region_cls_pred.weight" in bare:
        values["num_region_classes"] = bare["vlbert.mvrc_head.region_cls_pred.weight"].shape[0]
    return VlBertConfig.from_dict(values)


def read_release_file(
    path: str | Path, num_attention_heads: int | None = None
) -> tuple[nn.Module, ConversionReport]:
    """Our model for a release checkpoint: VQA when it has the [MASK]-answer classifier, pre-training when
    it has the MLM head, NLVR2 for an xmodal-shaped pair classifier, the backbone otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: give a VL-BERT release checkpoint (.model / .pth)")
    state = read_weights(path)
    bare = {k.removeprefix("module."): v for k, v in state.items()}
    required = ("vlbert.word_embeddings.weight", "image_feature_extractor.obj_downsample.1.weight")
    absent = [k for k in required if k not in bare]
    if absent:
        raise ValueError(
            f"{path}: not a VL-BERT checkpoint, {absent} missing (expected module.vlbert.* keys); "
            f"first keys: {sorted(state)[:5]}"
        )
    try:
        cfg = infer_config(state, num_attention_heads)
    except KeyError as err:
        raise ValueError(f"{path}: incomplete VL-BERT backbone, {err.args[0]} is missing") from err
    model: nn.Module
    if "final_mlp.0.dense.weight" in bare and "final_mlp.2.weight" in bare:
        model = VlBertForQuestionAnswering(cfg, num_answers=bare["final_mlp.2.weight"].shape[0])
    elif "final_mlp.4.weight" in bare and bare["final_mlp.4.weight"].shape[0] == 2:
        model = VlBertForNLVR2(cfg)
    elif "vlbert.mlm_head.predictions.bias" in bare:
        model = VlBertForPreTraining(cfg)
    else:
        model = VlBert(cfg)
    return model, load_release_state(model, state, str(path))


def convert_vlbert(src: str | Path, dst_dir: str | Path, num_attention_heads: int | None = None) -> Path:
    """A VL-BERT release checkpoint (`vl-bert_base_res101_pretrain_multitask_cc_wiki.model`, a VQA
    fine-tuned `.model`) -> an xmodal directory. Every weight name is accounted for in the log."""
    model, report = read_release_file(src, num_attention_heads)
    report.log()
    dst = Path(dst_dir)
    model.save_pretrained(dst)
    log.info("converted %s (%s) -> %s", src, type(model).__name__, dst)
    return dst
