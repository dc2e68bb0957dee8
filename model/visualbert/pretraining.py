"""`VisualBertForPreTraining`: masked LM with the image in view, and sentence-image matching."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.bert import MaskedLMPredictions
from ..layers.init import init_weights
from ..layers.labelled import masked_lm_loss
from ..pretrained import PretrainedMixin
from .config import VisualBertConfig
from .modeling import VisualBert


@dataclass
class VisualBertPreTrainingOutput:
    """`loss` is the sum of `losses` (0 without labels). With `lm_labels`, `lm_logits` is (M, V) at the M
    labelled text positions (row-major order); without any label it covers every text position."""

    loss: torch.Tensor
    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    lm_logits: torch.Tensor | None = None
    matched_logits: torch.Tensor | None = None
    text_output: torch.Tensor | None = None
    region_output: torch.Tensor | None = None
    pooled_output: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


class PreTrainingHeads(nn.Module):
    """`predictions` (masked LM, decoder tied to the word table) and `seq_relationship` (matching)."""

    def __init__(self, cfg: VisualBertConfig):
        super().__init__()
        self.predictions = MaskedLMPredictions(cfg, cfg.vocab_size)
        self.seq_relationship = nn.Linear(cfg.hidden_size, 2)


class VisualBertForPreTraining(PretrainedMixin, nn.Module):
    """VisualBERT with the two pre-training objectives of the paper (module names as transformers')."""

    config_class = VisualBertConfig
    base_model_prefix = "visual_bert."

    def __init__(self, cfg: VisualBertConfig):
        super().__init__()
        self.config = cfg
        self.visual_bert = VisualBert(cfg)
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
    ) -> VisualBertPreTrainingOutput:
        """lm_labels (B, L) over the text, -100 = not masked; matched_labels (B,) 1 = the sentence
        describes the image. Either enables its loss; labels at text padding count for nothing."""
        out = self.visual_bert(
            input_ids,
            attention_mask,
            token_type_ids,
            visual_feats,
            visual_pos,
            visual_attention_mask,
            output_attentions,
        )
        words = self.visual_bert.embeddings.word_embeddings.weight
        text = out.text_output
        result = VisualBertPreTrainingOutput(
            loss=text.new_zeros(()),
            text_output=text,
            region_output=out.region_output,
            pooled_output=out.pooled_output,
            attentions=out.attentions,
        )
        inference = lm_labels is None and matched_labels is None
        if lm_labels is not None:
            result.lm_logits, result.losses["mlm"] = masked_lm_loss(
                lambda rows: self.cls.predictions(rows, words), text, lm_labels, attention_mask
            )
        elif inference:
            result.lm_logits = self.cls.predictions(text, words)
        if matched_labels is not None or inference:
            result.matched_logits = self.cls.seq_relationship(out.pooled_output)
        if matched_labels is not None:
            result.losses["matched"] = F.cross_entropy(result.matched_logits, matched_labels)
        if result.losses:
            result.loss = torch.stack(list(result.losses.values())).sum()
        return result
