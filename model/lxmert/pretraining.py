"""`LxmertForPreTraining`: the backbone with the five pre-training heads and their losses (SPEC §2)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import static_layout_on
from ..layers.heads import ClassifierHead
from ..layers.init import init_weights
from ..layers.labelled import masked_lm_loss
from ..layers.tied import TiedWords
from ..pretrained import PretrainedMixin
from .config import LxmertConfig
from .heads import MaskedLMHead, ObjectHead
from .modeling import Lxmert


@dataclass
class PreTrainingOutput:
    """`loss` is the sum of `losses` (0 when no label was given). Logits exist where computed:
    with any label only the heads that have labels run, `lm_logits` is (M, V) at the M positions
    where `lm_labels != -100` and `feat_pred` is (K, D) at the K slots where `feat_weights != 0`
    (row-major order); with no label at all every head runs everywhere. Padding has no state (the encoders
    skip it; its outputs are zero), so labels and weights at padded tokens and boxes are ignored."""

    loss: torch.Tensor
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    lm_logits: torch.Tensor | None = None
    matched_logits: torch.Tensor | None = None
    obj_logits: torch.Tensor | None = None
    attr_logits: torch.Tensor | None = None
    feat_pred: torch.Tensor | None = None
    answer_logits: torch.Tensor | None = None
    language_output: torch.Tensor | None = None
    vision_output: torch.Tensor | None = None
    pooled_output: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


def _mean_over_labelled(summed: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """Mean that is 0, not NaN, when nothing is labelled."""
    if isinstance(count, torch.Tensor):
        return summed / count.clamp(min=1)
    return summed / max(count, 1)


class LxmertForPreTraining(PretrainedMixin, nn.Module):
    """LXMERT with masked-LM, matching, object label / attribute / feature and image-QA heads."""

    config_class = LxmertConfig
    base_model_prefix = "lxmert."

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.config = cfg
        self.lxmert = Lxmert(cfg)
        self.mlm_head = MaskedLMHead(cfg)
        self.match_head = nn.Linear(cfg.hidden_size, 2)
        self.object_head = ObjectHead(cfg)
        self.qa_head = ClassifierHead(
            cfg.hidden_size, 2 * cfg.hidden_size, cfg.num_qa_labels, cfg.layer_norm_eps
        )
        for head in (self.mlm_head, self.match_head, self.object_head, self.qa_head):
            head.apply(lambda m: init_weights(m, cfg.initializer_range))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        visual_feats: torch.Tensor | None = None,
        visual_pos: torch.Tensor | None = None,
        visual_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        lm_labels: torch.Tensor | None = None,
        matched_labels: torch.Tensor | None = None,
        obj_labels: torch.Tensor | None = None,
        obj_weights: torch.Tensor | None = None,
        attr_labels: torch.Tensor | None = None,
        attr_weights: torch.Tensor | None = None,
        feat_targets: torch.Tensor | None = None,
        feat_weights: torch.Tensor | None = None,
        answer_labels: torch.Tensor | None = None,
    ) -> PreTrainingOutput:
        """Backbone inputs as `Lxmert.forward`; every label is optional and enables its loss:
        lm_labels (B, L), -100 = not masked; matched_labels (B,) 1 = sentence matches the image;
        obj/attr_labels (B, N) with obj/attr_weights (B, N); feat_targets (B, N, D) with feat_weights (B, N);
        answer_labels (B,), -100 = no QA for this example. Labels at padding (mask 0) count for nothing."""
        visual = {
            "obj": (obj_labels, obj_weights),
            "attr": (attr_labels, attr_weights),
            "feat": (feat_targets, feat_weights),
        }
        for name, (target, weight) in visual.items():
            if (target is None) != (weight is None):
                raise ValueError(f"{name}: give both the targets and the weights, or neither")
        word = self.lxmert.embeddings.word.weight
        words: torch.Tensor | TiedWords = word
        inputs_embeds = None
        # Compiled graphs keep plain autograd: TiedWords' backwards hand a buffer over through Python state.
        training_mlm = lm_labels is not None and word.requires_grad and torch.is_grad_enabled()
        if training_mlm and not torch.compiler.is_compiling():
            words = TiedWords(word)
            inputs_embeds = words.lookup(input_ids)
        out = self.lxmert(
            input_ids,
            attention_mask,
            token_type_ids,
            visual_feats,
            visual_pos,
            visual_attention_mask,
            output_attentions,
            inputs_embeds,
        )
        labels = (lm_labels, matched_labels, obj_labels, attr_labels, feat_targets, answer_labels)
        inference = all(x is None for x in labels)
        result = PreTrainingOutput(
            loss=out.pooled_output.new_zeros(()),
            language_output=out.language_output,
            vision_output=out.vision_output,
            pooled_output=out.pooled_output,
            attentions=out.attentions,
        )
        losses = result.losses

        if lm_labels is not None:
            result.lm_logits, losses["mlm"] = masked_lm_loss(
                lambda rows: self.mlm_head(rows, words), out.language_output, lm_labels, attention_mask
            )
        elif inference:
            result.lm_logits = self.mlm_head(out.language_output, word)

        if matched_labels is not None or inference:
            result.matched_logits = self.match_head(out.pooled_output)
        if matched_labels is not None:
            losses["matched"] = F.cross_entropy(result.matched_logits, matched_labels)

        if inference or obj_labels is not None or attr_labels is not None or feat_targets is not None:
            self._object_losses(out.vision_output, visual, visual_attention_mask, result, inference)

        if answer_labels is not None or inference:
            result.answer_logits = self.qa_head(out.pooled_output)
        if answer_labels is not None:
            summed = F.cross_entropy(result.answer_logits, answer_labels, ignore_index=-100, reduction="sum")
            losses["qa"] = _mean_over_labelled(summed, (answer_labels != -100).sum())

        if losses:
            result.loss = torch.stack(list(losses.values())).sum()
        return result

    def _object_losses(
        self,
        vision: torch.Tensor,
        visual: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]],
        mask: torch.Tensor | None,
        result: PreTrainingOutput,
        inference: bool,
    ) -> None:
        """Per-slot loss x weight, averaged over all B x N slots, x visual_loss_scale."""
        head = self.object_head
        h = head.transform(vision)
        scale = self.config.visual_loss_scale
        if mask is not None:
            visual = {k: (t, None if w is None else w * mask) for k, (t, w) in visual.items()}
        obj, attr, feat = visual["obj"], visual["attr"], visual["feat"]
        if obj[0] is not None or inference:
            result.obj_logits = head.obj(h)
        if attr[0] is not None or inference:
            result.attr_logits = head.attr(h)
        if inference:
            result.feat_pred = head.feat(h)
        for name, logits, (target, weight) in (
            ("obj", result.obj_logits, obj),
            ("attr", result.attr_logits, attr),
        ):
            if target is not None:
                per_slot = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
                result.losses[name] = (per_slot * weight.flatten()).mean() * scale
        target, weight = feat
        if target is not None and static_layout_on():  # a compiled step: every slot, a fixed shape
            result.feat_pred = head.feat(h)
            per_slot = F.smooth_l1_loss(result.feat_pred, target.to(result.feat_pred.dtype), reduction="none")
            result.losses["feat"] = (per_slot.mean(-1) * weight).sum() / weight.numel() * scale
        elif target is not None:
            # Only the ~15% masked slots carry weight: regress the 2048-d features there alone.
            picked = weight != 0
            result.feat_pred = head.feat(h[picked])
            target = target[picked].to(result.feat_pred.dtype)
            per_slot = F.smooth_l1_loss(result.feat_pred, target, reduction="none")
            result.losses["feat"] = (per_slot.mean(-1) * weight[picked]).sum() / weight.numel() * scale
