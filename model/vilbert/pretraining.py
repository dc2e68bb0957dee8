"""`VilbertForPreTraining`: masked LM, masked-region classification and image-text alignment (SPEC §5)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from model.layers.attention import static_layout_on
from model.layers.init import init_weights
from model.layers.labelled import masked_lm_loss
from model.pretrained import PretrainedMixin

from .config import VilbertConfig
from .embeddings import pretraining_image_feats
from .heads import PreTrainingHeads
from .modeling import Vilbert


@dataclass
class VilbertPreTrainingOutput:
    """`loss` is the sum of `losses` (0 without labels). With labels only the labelled heads run:
    `lm_logits` is (M, V) at the M positions where `lm_labels != -100`, `region_logits` (K, C) at the K
    masked real regions (row-major order); without any label every head runs everywhere and
    `region_logits` is (B, N, C) for the regions (the global token excluded)."""

    loss: torch.Tensor
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    lm_logits: torch.Tensor | None = None
    matched_logits: torch.Tensor | None = None
    region_logits: torch.Tensor | None = None
    text_output: torch.Tensor | None = None
    vision_output: torch.Tensor | None = None
    pooled_output: torch.Tensor | None = None
    co_attentions: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None


class VilbertForPreTraining(PretrainedMixin, nn.Module):
    """The backbone (`bert`) with the release's pre-training heads (`cls`)."""

    config_class = VilbertConfig
    base_model_prefix = "bert."
    # Of the regions picked for masking, the shares zeroed and replaced by another image's: the release
    # zeroes 90 % and keeps 10 % (LXMERT: 80 / 10 / 10 kept).
    REGION_MASKING = (0.9, 0.0)

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        self.config = cfg
        self.bert = Vilbert(cfg)
        self.cls = PreTrainingHeads(cfg)
        self.cls.apply(lambda m: init_weights(m, cfg.initializer_range))

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
        region_mask: torch.Tensor | None = None,
        region_probs: torch.Tensor | None = None,
        region_labels: torch.Tensor | None = None,
        region_weights: torch.Tensor | None = None,
        image_feats: torch.Tensor | None = None,
    ) -> VilbertPreTrainingOutput:
        """Backbone inputs as `Vilbert.forward`. Labels, each optional and enabling its loss:
        lm_labels (B, L), -100 = not masked; matched_labels (B,) 1 = the caption belongs to the image;
        region_mask (B, N) 1 = region masked, with either region_probs (B, N, C), the detector's class
        distribution (loss: KL(target || softmax(logits)) summed over classes, mean over masked regions),
        or region_labels (B, N) with region_weights (B, N), a hard label and its confidence (loss: CE x
        confidence, mean over masked regions). Labels at padding count for nothing. With region_mask the
        global image token is the release loader's (`pretraining_image_feats`), not the plain mean;
        image_feats (B, D) sets it."""
        if (
            region_mask is not None
            and region_probs is None
            and (region_labels is None or region_weights is None)
        ):
            raise ValueError("region_mask needs region_probs, or region_labels with region_weights")
        if (
            image_feats is None
            and region_mask is not None
            and visual_feats is not None
            and visual_pos is not None
        ):
            image_feats = pretraining_image_feats(
                visual_feats, visual_pos, visual_attention_mask, region_mask
            )
        out = self.bert(
            input_ids,
            attention_mask,
            token_type_ids,
            visual_feats,
            visual_pos,
            visual_attention_mask,
            output_attentions,
            image_feats=image_feats,
        )
        words = self.bert.embeddings.word_embeddings.weight
        inference = lm_labels is None and matched_labels is None and region_mask is None
        result = VilbertPreTrainingOutput(
            loss=out.pooled_output.new_zeros(()),
            text_output=out.text_output,
            vision_output=out.vision_output,
            pooled_output=out.pooled_output,
            co_attentions=out.co_attentions,
        )
        losses = result.losses
        regions = out.vision_output[:, 1:]  # the global token has no target

        if lm_labels is not None:
            result.lm_logits, losses["mlm"] = masked_lm_loss(
                lambda rows: self.cls.predictions(rows, words), out.text_output, lm_labels, attention_mask
            )
        elif inference:
            result.lm_logits = self.cls.predictions(out.text_output, words)

        if matched_labels is not None or inference:
            result.matched_logits = self.cls.bi_seq_relationship(self.cls.dropout(out.pooled_output))
        if matched_labels is not None:
            losses["matched"] = F.cross_entropy(result.matched_logits, matched_labels)

        if region_mask is not None:
            picked = region_mask.bool()
            if visual_attention_mask is not None:
                picked = picked & visual_attention_mask.bool()
            count = picked.sum().clamp(min=1)
            if static_layout_on():  # a compiled step: every region, the others weighted 0 (fixed shapes)
                logits = self.cls.imagePredictions(regions)
                result.region_logits = logits
                log_probs = F.log_softmax(logits.float(), dim=-1)
                if region_probs is not None:
                    target = region_probs.float()
                    kl = (torch.xlogy(target, target) - target * log_probs) * picked[..., None]
                    losses["region"] = kl.sum() / count
                else:
                    labels = region_labels.masked_fill(~picked, 0)
                    ce = F.nll_loss(log_probs.flatten(0, 1), labels.flatten(), reduction="none")
                    weights = (region_weights.float() * picked).flatten()
                    losses["region"] = (ce * weights).sum() / count
            else:
                logits = self.cls.imagePredictions(regions[picked])
                result.region_logits = logits
                log_probs = F.log_softmax(logits.float(), dim=-1)
                if region_probs is not None:
                    target = region_probs[picked].float()
                    # KL(target || pred) with 0 log 0 = 0, as nn.KLDivLoss computes it.
                    kl = torch.xlogy(target, target) - target * log_probs
                    losses["region"] = kl.sum() / count
                else:
                    ce = F.nll_loss(log_probs, region_labels[picked], reduction="none")
                    losses["region"] = (ce * region_weights[picked].float()).sum() / count
        elif inference:
            result.region_logits = self.cls.imagePredictions(regions)

        if losses:
            result.loss = torch.stack(list(losses.values())).sum()
        return result
