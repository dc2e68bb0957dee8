"""VisualBERT fine-tuning heads: VQA/GQA answers and NLVR2 pairs, as transformers' task classes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.init import init_weights
from ..outputs import ClassificationOutput
from ..pretrained import PretrainedMixin
from .config import VisualBertConfig
from .modeling import VisualBert


class VisualBertForQuestionAnswering(PretrainedMixin, nn.Module):
    """The state of the last text token before [SEP] -> dropout -> Linear(H, A) (transformers' and the
    authors' choice of answer token). Loss: KL(labels || softmax(logits)), batch mean, as transformers."""

    config_class = VisualBertConfig
    base_model_prefix = "visual_bert."

    def __init__(self, cfg: VisualBertConfig, num_answers: int):
        super().__init__()
        self.config = cfg
        self.num_answers = num_answers
        self.visual_bert = VisualBert(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.cls = nn.Linear(cfg.hidden_size, num_answers)
        init_weights(self.cls, cfg.initializer_range)

    def init_kwargs(self) -> dict[str, int]:
        return {"num_answers": self.num_answers}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        visual_feats: torch.Tensor | None = None,
        visual_pos: torch.Tensor | None = None,
        visual_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        labels: torch.Tensor | None = None,
    ) -> ClassificationOutput:
        """Text `[CLS] question [SEP]` padded on the right; labels (B, A) answer scores (a distribution
        gives transformers' loss exactly; VQA soft scores work as unnormalised targets)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        out = self.visual_bert(
            input_ids,
            attention_mask,
            token_type_ids,
            visual_feats,
            visual_pos,
            visual_attention_mask,
            output_attentions,
        )
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        answer_at = attention_mask.sum(1).long() - 2
        logits = self.cls(self.dropout(out.sequence_output[rows, answer_at]))
        loss = None
        if labels is not None:
            loss = F.kl_div(logits.log_softmax(-1), labels.to(logits.dtype), reduction="batchmean")
        region_attention = None
        if output_attentions:
            last = out.attentions[-1][rows, :, answer_at]  # (B, heads, L + N)
            region_attention = last[..., out.text_length :].mean(1)
        return ClassificationOutput(
            logits=logits, loss=loss, attentions=out.attentions, region_attention=region_attention
        )


class VisualBertForNLVR2(PretrainedMixin, nn.Module):
    """One sentence and both images in one sequence -> pooled -> dropout -> Linear(H, 2), as transformers'
    `VisualBertForVisualReasoning`. The layout is uclanlp/visualbert's (`nlvr_dataset.py`), which its
    released `visualbert-nlvr2` was trained with: image i's regions have visual token type i, and every
    region the visual position 0."""

    config_class = VisualBertConfig
    base_model_prefix = "visual_bert."

    def __init__(self, cfg: VisualBertConfig):
        super().__init__()
        self.config = cfg
        self.visual_bert = VisualBert(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.cls = nn.Linear(cfg.hidden_size, 2)
        init_weights(self.cls, cfg.initializer_range)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        visual_feats: torch.Tensor | None = None,
        visual_pos: torch.Tensor | None = None,
        visual_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        labels: torch.Tensor | None = None,
    ) -> ClassificationOutput:
        """Text (B, L); visual_feats (B, 2, N, D), visual mask (B, 2, N); labels (B,) in {0, 1}."""
        if visual_feats is None or visual_feats.dim() != 4 or visual_feats.shape[1] != 2:
            shape = None if visual_feats is None else tuple(visual_feats.shape)
            raise ValueError(f"NLVR2 expects visual_feats of shape (B, 2, N, D), got {shape}")
        b, _, n, _ = visual_feats.shape
        image = torch.arange(2, device=visual_feats.device).repeat_interleave(n).expand(b, -1)
        if self.config.type_vocab_size < 2:
            raise ValueError("VisualBERT's NLVR2 layout needs type_vocab_size >= 2 (one type per image)")
        mask = None if visual_attention_mask is None else visual_attention_mask.flatten(1, 2)
        out = self.visual_bert(
            input_ids,
            attention_mask,
            token_type_ids,
            visual_feats.flatten(1, 2),
            None,
            mask,
            output_attentions,
            visual_token_type_ids=image,
        )
        logits = self.cls(self.dropout(out.pooled_output))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        region_attention = None
        if output_attentions:  # [CLS]'s, which the pooler reads, over both images' regions
            region_attention = out.attentions[-1][:, :, 0, out.text_length :].mean(1).view(b, 2, n)
        return ClassificationOutput(
            logits=logits, loss=loss, attentions=out.attentions, region_attention=region_attention
        )
