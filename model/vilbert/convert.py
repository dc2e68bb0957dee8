"""Released ViLBERT checkpoints -> xmodal directories, with a report of every name.

Two layouts are read (`torch.load(weights_only=True)`, `module.` stripped, `gamma`/`beta` renamed):
- vilbert-multi-task (`pretrained_model.bin`: `bert.*` + `cls.*`; `multi_task_model.bin`: also the task
  heads `vil_prediction`, `vil_prediction_gqa`, `vil_binary_prediction`, `vil_logit`, ... and
  `bert.embeddings.task_embeddings`): names are ours already, except the tied MLM decoder and the
  co-attention outputs' unused `q_dense1`/`q_dense2`, which are dropped.
- volta (`BertForVLPreTraining`): one list of sublayers `bert.encoder.layer.S`, attention and
  feed-forward alternating, each carrying a text part (`query`, `dense`, `LayerNorm`) and/or a visual part
  (`v_query`, `v_dense`, `v_LayerNorm`); ViLBERT's layers and co-attention layers are read back out of it.
Both keep their meaning: the alignment head's two rows are swapped (the release's "matched" is row 0,
xmodal's row 1) and the region head's rows rotated so the background class comes last, as in the store.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..files import read_json, regular_file
from ..row_order import background_last, swap_match_rows
from .config import VilbertConfig
from .finetuning import VilbertForNLVR2, VilbertForQuestionAnswering, VilbertForRetrieval
from .modeling import Vilbert
from .pretraining import VilbertForPreTraining

log = logging.getLogger(__name__)

# Our weights whose rows the releases order otherwise (model/row_order.py): the release's alignment head
# scores "matched" at row 0 (concept_cap_dataset.py's is_next = 0) and its region head puts the
# background class first.
_REORDER = {
    "cls.bi_seq_relationship.weight": swap_match_rows,
    "cls.bi_seq_relationship.bias": swap_match_rows,
    "cls.imagePredictions.decoder.weight": background_last,
    "cls.imagePredictions.decoder.bias": background_last,
}

# head choice -> (class, the release's head module name, our head module name)
HEADS: dict[str, tuple[type, str | None, str | None]] = {
    "backbone": (Vilbert, None, None),
    "pretraining": (VilbertForPreTraining, "cls", "cls"),
    "vqa": (VilbertForQuestionAnswering, "vil_prediction", "vil_prediction"),
    "gqa": (VilbertForQuestionAnswering, "vil_prediction_gqa", "vil_prediction"),
    "nlvr2": (VilbertForNLVR2, "vil_binary_prediction", "vil_binary_prediction"),
    "retrieval": (VilbertForRetrieval, "vil_logit", "vil_logit"),
}
# Heads a released file may hold besides the one converted (vilbert-multi-task's VILBertForVLTasks).
RELEASE_HEADS = (
    "cls",
    "vil_prediction",
    "vil_prediction_gqa",
    "vil_binary_prediction",
    "vil_logit",
    "vil_tri_prediction",
    "vision_logit",
    "linguisic_logit",
)
# Fields a vilbert-multi-task config JSON (bert_base_6layer_6conect.json) shares with VilbertConfig.
_REFERENCE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "num_hidden_layers",
    "max_position_embeddings",
    "type_vocab_size",
    "v_feature_size",
    "v_target_size",
    "v_hidden_size",
    "v_num_attention_heads",
    "v_intermediate_size",
    "v_num_hidden_layers",
    "bi_hidden_size",
    "bi_num_attention_heads",
    "v_biattention_id",
    "t_biattention_id",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "v_hidden_dropout_prob",
    "v_attention_probs_dropout_prob",
    "initializer_range",
    "fusion_method",
    "num_locs",
)


@dataclass
class ConversionReport:
    """What happened to every name: `converted` source keys, `dropped` ones with the reason, and the
    problems — `unexpected` source keys, `missing` model keys, `mis_shaped` pairs."""

    source: str
    layout: str
    architecture: str
    converted: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    mis_shaped: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.unexpected or self.missing or self.mis_shaped)

    def summary(self, dropped: bool = False) -> str:
        """One line of counts, then one line per kind of problem naming every weight (and, with
        `dropped`, one per dropped weight with the reason)."""
        problems = (
            ("unexpected (not understood)", self.unexpected),
            ("missing (left freshly initialised)", self.missing),
            ("of another shape", self.mis_shaped),
        )
        counts = [f"{len(self.converted)} weights converted", f"{len(self.dropped)} dropped"]
        counts += [f"{len(names)} {title.split(' (')[0]}" for title, names in problems if names]
        lines = [f"{self.source} ({self.layout}) -> {self.architecture}: {', '.join(counts)}"]
        lines += [f"  {len(names)} {title}: {', '.join(names)}" for title, names in problems if names]
        if dropped:
            lines += [f"  dropped {name}: {reason}" for name, reason in self.dropped.items()]
        return "\n".join(lines)


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """A released file's tensors with `module.` stripped and TF-style `gamma`/`beta` renamed."""
    regular_file(path, "weights")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        reason = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise ValueError(f"{path}: cannot be read as a tensors-only checkpoint ({reason})") from err
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state dict of tensors")
    out = {}
    for key, value in state.items():
        parts = [p for p in key.split(".") if p != "module"]
        parts[-1] = {"gamma": "weight", "beta": "bias"}.get(parts[-1], parts[-1])
        out[".".join(parts)] = value
    return out


def detect_layout(state: dict[str, torch.Tensor], source: str) -> str:
    if any(re.match(r"bert\.encoder\.layer\.\d+\.attention_self\.", k) for k in state):
        return "volta"
    if any(k.startswith("bert.encoder.c_layer.") for k in state):
        return "vilbert-multi-task"
    raise ValueError(
        f"{source}: no ViLBERT backbone found (expected bert.encoder.c_layer.* as in vilbert-multi-task "
        f"or bert.encoder.layer.N.attention_self.* as in volta); first keys: {sorted(state)[:5]}"
    )


def config_from_reference(values: dict[str, Any]) -> dict[str, Any]:
    """VilbertConfig fields from a vilbert-multi-task or volta model config JSON."""
    out = {k: values[k] for k in _REFERENCE_FIELDS if k in values}
    if "v_feature_size" in out:
        out["visual_feat_dim"] = out.pop("v_feature_size")
    if "pooling_method" in values and "fusion_method" not in values:
        out["fusion_method"] = values["pooling_method"]
    if "tt_attn_sublayers" in values:  # volta: placement and co-attention sizes live in the sublayer lists
        co = sorted(values["tv_attn_sublayers"])
        text = sorted(n for n in values["tt_attn_sublayers"] if n not in co)
        vision = sorted(n for n in values["vv_attn_sublayers"] if n not in co)
        out["num_hidden_layers"] = len(text)
        out["v_num_hidden_layers"] = len(vision)
        out["t_biattention_id"] = [sum(n < s for n in text) for s in co]
        out["v_biattention_id"] = [sum(n < s for n in vision) for s in co]
        if co:
            out["bi_hidden_size"] = int(
                values["sublayer2attn_hidden_size"].get(str(co[0]), values["hidden_size"])
            )
            out["bi_num_attention_heads"] = int(
                values["sublayer2num_attention_heads"].get(str(co[0]), values["num_attention_heads"])
            )
    return out


@dataclass
class _Block:
    """One volta attention + feed-forward sublayer pair and the ViLBERT layers it carries."""

    index: int
    text: int | None = None
    vision: int | None = None
    co: int | None = None


def volta_blocks(cfg: VilbertConfig) -> list[_Block]:
    """Volta's sublayer pairs for a ViLBERT config: per stage, its text and visual layers side by side
    (one pair while both have layers left), then the stage's co-attention layer."""
    blocks: list[_Block] = []
    stages = [*zip(cfg.t_biattention_id, cfg.v_biattention_id, strict=True)]
    stages.append((cfg.num_hidden_layers, cfg.v_num_hidden_layers))
    t = v = 0
    for k, (t_end, v_end) in enumerate(stages):
        for ti, vi in zip_longest(range(t, t_end), range(v, v_end)):
            blocks.append(_Block(len(blocks), text=ti, vision=vi))
        if k < cfg.num_co_layers:
            blocks.append(_Block(len(blocks), co=k))
        t, v = t_end, v_end
    return blocks


def _weights(pairs: list[tuple[str, str]]) -> dict[str, str]:
    return {f"{a}.{p}": f"{b}.{p}" for a, b in pairs for p in ("weight", "bias")}


def volta_names(cfg: VilbertConfig) -> dict[str, str]:
    """volta encoder key -> our key, for every encoder weight."""
    names: dict[str, str] = {}
    for blk in volta_blocks(cfg):
        a = f"bert.encoder.layer.{2 * blk.index}"
        f = f"bert.encoder.layer.{2 * blk.index + 1}"
        if blk.co is not None:
            c = f"bert.encoder.c_layer.{blk.co}"
            names |= _weights(
                [(f"{a}.attention_self.{n}", f"{c}.biattention.{n}2") for n in ("query", "key", "value")]
                + [(f"{a}.attention_self.v_{n}", f"{c}.biattention.{n}1") for n in ("query", "key", "value")]
                + [
                    (f"{a}.attention_output.dense", f"{c}.biOutput.dense2"),
                    (f"{a}.attention_output.LayerNorm", f"{c}.biOutput.LayerNorm2"),
                    (f"{a}.attention_output.v_dense", f"{c}.biOutput.dense1"),
                    (f"{a}.attention_output.v_LayerNorm", f"{c}.biOutput.LayerNorm1"),
                    (f"{f}.intermediate.dense", f"{c}.t_intermediate.dense"),
                    (f"{f}.output.dense", f"{c}.t_output.dense"),
                    (f"{f}.output.LayerNorm", f"{c}.t_output.LayerNorm"),
                    (f"{f}.intermediate.v_dense", f"{c}.v_intermediate.dense"),
                    (f"{f}.output.v_dense", f"{c}.v_output.dense"),
                    (f"{f}.output.v_LayerNorm", f"{c}.v_output.LayerNorm"),
                ]
            )
        for layer, ours, v in ((blk.text, "layer", ""), (blk.vision, "v_layer", "v_")):
            if layer is None:
                continue
            o = f"bert.encoder.{ours}.{layer}"
            names |= _weights(
                [(f"{a}.attention_self.{v}{n}", f"{o}.attention.self.{n}") for n in ("query", "key", "value")]
                + [
                    (f"{a}.attention_output.{v}dense", f"{o}.attention.output.dense"),
                    (f"{a}.attention_output.{v}LayerNorm", f"{o}.attention.output.LayerNorm"),
                    (f"{f}.intermediate.{v}dense", f"{o}.intermediate.dense"),
                    (f"{f}.output.{v}dense", f"{o}.output.dense"),
                    (f"{f}.output.{v}LayerNorm", f"{o}.output.LayerNorm"),
                ]
            )
    return names


def _rename(key: str, layout: str, head: str, encoder: dict[str, str]) -> tuple[str | None, str | None]:
    """(our key, None) or (None, why it is dropped) or (None, None) when the key is not understood."""
    if layout == "volta":
        if key.startswith("bert.encoder.layer."):
            return encoder.get(key), None
        if key.startswith("cls.imagePredictions.decoder_dict."):
            target = key.split(".")[3]
            if target == "0":  # volta's visual target 0 is the KL to the 1601-class distribution
                return key.replace("decoder_dict.0", "decoder"), None
            return None, f"visual target {target} has no ViLBERT head"
        if key.startswith("clfs_dict."):
            return None, "volta task head: fine-tune the converted backbone instead"
    elif re.match(r"bert\.encoder\.c_layer\.\d+\.biOutput\.q_dense[12]\.", key):
        return None, "unused by the release's forward"
    if key == "cls.predictions.decoder.weight":
        return None, "tied to bert.embeddings.word_embeddings.weight"
    if key.startswith("bert."):
        return key, None
    module = key.split(".")[0]
    _, theirs, ours = HEADS[head]
    if module == theirs and ours is not None:
        return ours + key[len(theirs) :], None
    if module in RELEASE_HEADS:
        return None, f"head not converted (head={head!r})"
    return None, None


def _default_head(state: dict[str, torch.Tensor]) -> str:
    if "vil_prediction.logit_fc.3.weight" in state:
        return "vqa"
    if any(k.startswith("cls.") for k in state):
        return "pretraining"
    return "backbone"


def convert_vilbert(
    src_file: str | Path,
    out_dir: str | Path,
    *,
    preset: str = "base",
    config_file: str | Path | None = None,
    head: str | None = None,
    task_token: int | None = None,
    strict: bool = True,
) -> Path:
    """Convert a released ViLBERT file into an xmodal directory at `out_dir` (see `load_release`)."""
    model, report = load_release(
        src_file, preset=preset, config_file=config_file, head=head, task_token=task_token, strict=strict
    )
    log.info(report.summary())
    return model.save_pretrained(out_dir)


def load_release(
    src_file: str | Path,
    *,
    preset: str = "base",
    config_file: str | Path | None = None,
    head: str | None = None,
    task_token: int | None = None,
    strict: bool = True,
) -> tuple[nn.Module, ConversionReport]:
    """A released ViLBERT file as an xmodal model, with the report of every name.

    Sizes come from `preset`, overridden by the release's config JSON (`config_file`, e.g.
    bert_base_6layer_6conect.json or volta's vilbert_base.json). `head`: which model to build (one of
    HEADS; default: `vqa` when the file has `vil_prediction`, else `pretraining` with `cls.*`, else
    `backbone`); the answer count is read off the head. `task_token`: the task row to use when the file has
    vilbert-multi-task's task embeddings (VQA is 1 in its task list). Every missing, unexpected or
    mis-shaped name is reported; unless `strict=False`, any of them stops the conversion (ValueError).
    """
    src = Path(src_file)
    if not src.is_file():
        raise FileNotFoundError(f"{src} does not exist: give a released .bin/.pth file")
    state = read_state(src)
    layout = detect_layout(state, str(src))
    head = head or _default_head(state)
    if head not in HEADS:
        raise ValueError(f"head {head!r}: choose one of {sorted(HEADS)}")
    values: dict[str, Any] = {}
    if config_file is not None:
        values = config_from_reference(read_json(config_file, "ViLBERT config"))
    task_table = state.get("bert.embeddings.task_embeddings.weight")
    if task_table is not None:
        values["task_vocab_size"] = task_table.shape[0]
        values["task_token"] = task_token
        if task_token is None:
            log.warning("%s: the file has task embeddings but no task_token was given; none is inserted", src)
    cfg = VilbertConfig.preset(preset, **values)

    cls, theirs, _ = HEADS[head]
    kwargs: dict[str, Any] = {}
    if cls is VilbertForQuestionAnswering:
        out_layer = state.get(f"{theirs}.logit_fc.3.weight")
        if out_layer is None:
            raise ValueError(f"{src}: head={head!r} needs {theirs}.logit_fc.3.weight, which the file lacks")
        kwargs["num_answers"] = out_layer.shape[0]
    model = cls(cfg, **kwargs)
    own = model.state_dict()
    prefix = model.base_model_prefix
    report = ConversionReport(str(src), layout, cls.__name__)
    encoder = volta_names(cfg) if layout == "volta" else {}
    loaded: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        ours, why = _rename(key, layout, head, encoder)
        if ours is not None and not prefix and ours.startswith("bert."):
            ours = ours[len("bert.") :]
        elif ours is not None and not prefix:
            ours, why = None, f"head not converted (head={head!r})"
        if why is not None:
            report.dropped[key] = why
        elif ours is None or ours not in own:
            report.unexpected.append(key)
        elif own[ours].shape != value.shape:
            report.mis_shaped.append(f"{key}: file {tuple(value.shape)} vs model {tuple(own[ours].shape)}")
        else:
            loaded[ours] = _REORDER[ours](value) if ours in _REORDER else value
            report.converted.append(key)
    report.missing = sorted(k for k in own if k not in loaded)
    if not report.ok:
        if strict:
            raise ValueError(report.summary() + "\nfix the config (config_file=...) or pass strict=False")
        log.warning(report.summary())
    model.load_state_dict(loaded, strict=False)
    return model, report
