"""`VlBertForPreTraining`: masked LM with visual clues and masked RoI classification with linguistic clues.

No sentence-image matching: the final VL-BERT dropped it (SPEC §5). A masked RoI keeps its box; its
appearance becomes a learned vector (zero at the start) and its [IMG] word a learned [MASK]-like word.
The whole image's appearance is the mean of the unmasked regions only, so that nothing of a masked
region leaks through it (the release zeroes a masked RoI's pixels before its whole-image RoI pooling).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.attention import static_layout_on
from ..layers.bert import MaskedLMPredictions
from ..layers.init import init_weights
from ..layers.labelled import masked_lm_loss
from ..pretrained import PretrainedMixin
from .config import VlBertConfig
from .modeling import VlBert


@dataclass
class VlBertPreTrainingOutput:
    """`loss` is the sum of `losses` (0 without labels). With labels, `lm_logits` is (M, V) at the M
    labelled text positions and `region_logits` (K, C) at the K masked real regions (row-major order);
    without any label they cover every text position and every region."""

    loss: torch.Tensor
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    lm_logits: torch.Tensor | None = None
    region_logits: torch.Tensor | None = None
    text_output: torch.Tensor | None = None
    region_output: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class MLMHead(nn.Module):
    def __init__(self, cfg: VlBertConfig):
        super().__init__()
        self.predictions = MaskedLMPredictions(cfg, cfg.vocab_size)


class MVRCTransform(nn.Module):
    """`gelu(W h)`."""

    def __init__(self, cfg: VlBertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class MVRCHead(nn.Module):
    """Masked visual-region classification: detector-class logits for a region's state."""

    def __init__(self, cfg: VlBertConfig):
        super().__init__()
        self.transform = MVRCTransform(cfg)
        self.region_cls_pred = nn.Linear(cfg.hidden_size, cfg.num_region_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.region_cls_pred(self.transform(x))


class VlBertForPreTraining(PretrainedMixin, nn.Module):
    """VL-BERT with the masked-LM and masked-RoI-classification heads (release names)."""

    config_class = VlBertConfig
    takes_image_size = True  # the pipelines pass `image_size` (pipelines.data.regions.inputs_for)
    base_model_prefix = "vlbert."
    WHOLE_WORD_MASKING: ClassVar[bool] = True  # the recipe: a word's pieces are masked together
    # the collator leaves masked regions' features as they are (none zeroed or swapped): the model
    # itself puts its learned masked appearance in their place
    REGION_MASKING: ClassVar[tuple[float, float]] = (0.0, 0.0)

    def __init__(self, cfg: VlBertConfig):
        super().__init__()
        self.config = cfg
        self.vlbert = VlBert(cfg)
        self.mlm_head = MLMHead(cfg)
        self.mvrc_head = MVRCHead(cfg)
        self.object_mask_visual_embedding = nn.Embedding(1, cfg.visual_feat_dim)
        self.object_mask_word_embedding = nn.Embedding(1, cfg.hidden_size)
        for module in (self.mlm_head, self.mvrc_head, self.object_mask_word_embedding):
            module.apply(lambda m: init_weights(m, cfg.initializer_range))
        nn.init.zeros_(self.object_mask_visual_embedding.weight)

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
        region_mask: torch.Tensor | None = None,
        region_probs: torch.Tensor | None = None,
        region_labels: torch.Tensor | None = None,
        region_weights: torch.Tensor | None = None,
        image_size: torch.Tensor | None = None,
    ) -> VlBertPreTrainingOutput:
        """Backbone inputs as `VlBert.forward`, and:
        lm_labels (B, L), -100 = not masked (the caller masks whole words);
        region_mask (B, N), 1 = a RoI whose appearance is hidden and whose class is predicted, against
        region_probs (B, N, C), the detector's class distribution, background last as the detector and the
        store order it (soft cross-entropy), or else region_labels (B, N), the detector's top object id,
        with region_weights (B, N), its confidence.
        Labels at padding count for nothing."""
        if region_mask is not None and region_probs is None and region_labels is None:
            raise ValueError("region_mask needs region_probs (B, N, C) or region_labels with region_weights")
        if (region_labels is None) != (region_weights is None):
            raise ValueError("region_labels and region_weights go together: give both or neither")
        masked_regions = None if region_mask is None else region_mask.bool()
        real = None if visual_attention_mask is None else visual_attention_mask.bool()
        image_feats = region_words = None
        if masked_regions is not None and visual_feats is not None:
            masked = masked_regions.bool()
            if real is not None:
                masked = masked & real
            visible = ~masked if real is None else real & ~masked
            weight = visible[..., None].to(visual_feats.dtype)
            image_feats = (visual_feats * weight).sum(1) / weight.sum(1).clamp(min=1)
            hidden = self.object_mask_visual_embedding.weight[0].to(visual_feats.dtype)
            visual_feats = torch.where(masked[..., None], hidden, visual_feats)
            words = self.vlbert.object_linguistic_embeddings.weight[0]
            region_words = torch.where(masked[..., None], self.object_mask_word_embedding.weight[0], words)
            masked_regions = masked
        out = self.vlbert(
            input_ids,
            attention_mask,
            token_type_ids,
            visual_feats,
            visual_pos,
            visual_attention_mask,
            output_attentions,
            image_feats=image_feats,
            image_size=image_size,
            region_words=region_words,
        )
        words_table = self.vlbert.word_embeddings.weight
        result = VlBertPreTrainingOutput(
            loss=out.sequence_output.new_zeros(()),
            text_output=out.text_output,
            region_output=out.region_output,
            attentions=out.attentions,
        )
        inference = lm_labels is None and masked_regions is None
        if lm_labels is not None:
            result.lm_logits, result.losses["mlm"] = masked_lm_loss(
                lambda rows: self.mlm_head.predictions(rows, words_table),
                out.text_output,
                lm_labels,
                attention_mask,
            )
        elif inference:
            result.lm_logits = self.mlm_head.predictions(out.text_output, words_table)
        if masked_regions is not None and static_layout_on():  # a compiled step: every region, fixed shapes
            logits = self.mvrc_head(out.region_output)
            result.region_logits = logits
            weight = masked_regions.to(logits.dtype)
            if region_probs is not None:
                per_region = -(region_probs.to(logits.dtype) * logits.log_softmax(-1)).sum(-1)
            else:
                labels = region_labels.masked_fill(~masked_regions, 0)
                per_region = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
                weight = weight * region_weights.to(logits.dtype)
                per_region = per_region.view_as(weight)
            result.losses["mvrc"] = (per_region * weight).sum() / masked_regions.sum().clamp(min=1)
        elif masked_regions is not None:
            logits = self.mvrc_head(out.region_output[masked_regions])
            result.region_logits = logits
            count = max(logits.shape[0], 1)
            if region_probs is not None:
                target = region_probs[masked_regions].to(logits.dtype)
                per_region = -(target * logits.log_softmax(-1)).sum(-1)
            else:
                per_region = F.cross_entropy(logits, region_labels[masked_regions], reduction="none")
                per_region = per_region * region_weights[masked_regions].to(logits.dtype)
            result.losses["mvrc"] = per_region.sum() / count
        elif inference:
            result.region_logits = self.mvrc_head(out.region_output)
        if result.losses:
            result.loss = torch.stack(list(result.losses.values())).sum()
        return result
