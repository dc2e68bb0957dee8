"""VL-BERT fine-tuning heads: VQA/GQA answered at the [MASK] of an answer segment, and NLVR2 pairs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.bert import PredictionTransform
from ..layers.heads import check_image_pairs, each_sentence_twice, image_rows, soft_score_loss
from ..layers.init import init_weights
from ..outputs import ClassificationOutput
from ..pretrained import PretrainedMixin
from .config import VlBertConfig
from .modeling import VlBert


def with_answer_segment(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    mask_token_id: int,
    sep_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[CLS] question [SEP]` (right-padded) -> `[CLS] question [SEP] [MASK] [SEP]`, the last two in segment
    B. Returns (ids, mask, token types, position of [MASK] per row), each text two tokens longer."""
    b = input_ids.shape[0]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if token_type_ids is None:
        token_type_ids = torch.zeros_like(input_ids)
    pad = input_ids.new_zeros(b, 2)
    ids = torch.cat([input_ids, pad], 1)
    mask = torch.cat([attention_mask, pad.to(attention_mask.dtype)], 1)
    types = torch.cat([token_type_ids, pad.to(token_type_ids.dtype)], 1)
    rows = torch.arange(b, device=input_ids.device)
    answer_at = attention_mask.sum(1).long()
    for offset, token in ((0, mask_token_id), (1, sep_token_id)):
        at = (rows, answer_at + offset)
        ids = ids.index_put(at, ids.new_tensor(token))
        mask = mask.index_put(at, mask.new_tensor(1))
        types = types.index_put(at, types.new_tensor(1))
    return ids, mask, types, answer_at


class VlBertForQuestionAnswering(PretrainedMixin, nn.Module):
    """The [MASK] state of the answer segment -> `final_mlp` (MLM transform, dropout, Linear(H, A));
    soft-score BCE x A, as the release trains it."""

    config_class = VlBertConfig
    takes_image_size = True  # the pipelines pass `image_size` (pipelines.data.regions.inputs_for)
    base_model_prefix = "vlbert."

    def __init__(self, cfg: VlBertConfig, num_answers: int):
        super().__init__()
        self.config = cfg
        self.num_answers = num_answers
        self.vlbert = VlBert(cfg)
        self.final_mlp = nn.Sequential(
            PredictionTransform(cfg),
            nn.Dropout(cfg.classifier_dropout_prob),
            nn.Linear(cfg.hidden_size, num_answers),
        )
        self.final_mlp.apply(lambda m: init_weights(m, cfg.initializer_range))

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
        image_size: torch.Tensor | None = None,
    ) -> ClassificationOutput:
        """Text `[CLS] question [SEP]` padded on the right (the answer segment is added here);
        labels (B, A) soft answer scores in [0, 1]."""
        cfg = self.config
        ids, mask, types, answer_at = with_answer_segment(
            input_ids, attention_mask, token_type_ids, cfg.mask_token_id, cfg.sep_token_id
        )
        out = self.vlbert(
            ids,
            mask,
            types,
            visual_feats,
            visual_pos,
            visual_attention_mask,
            output_attentions,
            image_size=image_size,
        )
        rows = torch.arange(ids.shape[0], device=ids.device)
        logits = self.final_mlp(out.text_output[rows, answer_at])
        loss = None
        if labels is not None:
            loss = soft_score_loss(logits, labels)
        region_attention = None
        if output_attentions:
            start = out.text_length + 1
            last = out.attentions[-1][rows, :, answer_at]  # (B, heads, S)
            region_attention = last[..., start : start + out.num_regions].mean(1)
        return ClassificationOutput(
            logits=logits, loss=loss, attentions=out.attentions, region_attention=region_attention
        )


class VlBertForNLVR2(PretrainedMixin, nn.Module):
    """One sentence, two images: [CLS](s, img0) ⊕ [CLS](s, img1) -> `final_mlp` (dropout, Linear(2H, H),
    ReLU, dropout, Linear(H, 2)), the release's two-layer classifier."""

    config_class = VlBertConfig
    takes_image_size = True  # the pipelines pass `image_size` (pipelines.data.regions.inputs_for)
    base_model_prefix = "vlbert."

    def __init__(self, cfg: VlBertConfig):
        super().__init__()
        self.config = cfg
        self.vlbert = VlBert(cfg)
        h, p = cfg.hidden_size, cfg.classifier_dropout_prob
        self.final_mlp = nn.Sequential(
            nn.Dropout(p), nn.Linear(2 * h, h), nn.ReLU(), nn.Dropout(p), nn.Linear(h, 2)
        )
        self.final_mlp.apply(lambda m: init_weights(m, cfg.initializer_range))

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
        image_size: torch.Tensor | None = None,
    ) -> ClassificationOutput:
        """Text (B, L); visual_feats (B, 2, N, D), visual_pos (B, 2, N, 4), visual mask (B, 2, N),
        image_size (B, 2, 2)."""
        check_image_pairs(visual_feats)
        out = self.vlbert(
            each_sentence_twice(input_ids),
            each_sentence_twice(attention_mask),
            each_sentence_twice(token_type_ids),
            image_rows(visual_feats),
            image_rows(visual_pos),
            image_rows(visual_attention_mask),
            output_attentions,
            image_size=image_rows(image_size),
        )
        b = input_ids.shape[0]
        logits = self.final_mlp(out.text_output[:, 0].reshape(b, -1))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        region_attention = None
        if output_attentions:  # [CLS]'s, which the classifier reads, over each image's regions
            start = out.text_length + 1
            per_pair = out.attentions[-1][:, :, 0, start : start + out.num_regions].mean(1)
            region_attention = per_pair.view(b, 2, -1)
        return ClassificationOutput(
            logits=logits, loss=loss, attentions=out.attentions, region_attention=region_attention
        )
