"""Fine-tuning models: VQA/GQA answer classification and the NLVR2 image-pair classifier (SPEC §2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.heads import ClassifierHead, check_image_pairs, each_sentence_twice, image_rows, soft_score_loss
from ..layers.init import init_weights
from ..outputs import ClassificationOutput
from ..pretrained import PretrainedMixin
from .config import LxmertConfig
from .modeling import Lxmert


def region_attention(attentions: tuple[torch.Tensor, ...] | None) -> torch.Tensor | None:
    """[CLS]'s attention over the regions in the last cross-modality layer, mean over heads: (B, N)."""
    if attentions is None:
        return None
    return attentions[-1][:, :, 0, :].mean(dim=1)


class LxmertForQuestionAnswering(PretrainedMixin, nn.Module):
    """Pooled output -> Linear(H, 2H) GELU LN Linear(2H, A); soft-score BCE as the release trains it."""

    config_class = LxmertConfig
    base_model_prefix = "lxmert."

    def __init__(self, cfg: LxmertConfig, num_answers: int):
        super().__init__()
        self.config = cfg
        self.num_answers = num_answers
        self.lxmert = Lxmert(cfg)
        self.answer_head = ClassifierHead(
            cfg.hidden_size, 2 * cfg.hidden_size, num_answers, cfg.layer_norm_eps
        )
        self.answer_head.apply(lambda m: init_weights(m, cfg.initializer_range))

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
        """labels (B, A): soft answer scores in [0, 1]; loss = BCE-with-logits (mean) x A."""
        out = self.lxmert(
            input_ids,
            attention_mask,
            token_type_ids,
            visual_feats,
            visual_pos,
            visual_attention_mask,
            output_attentions,
        )
        logits = self.answer_head(out.pooled_output)
        loss = None
        if labels is not None:
            loss = soft_score_loss(logits, labels)
        return ClassificationOutput(
            logits=logits,
            loss=loss,
            attentions=out.attentions,
            region_attention=region_attention(out.attentions),
        )


class LxmertForNLVR2(PretrainedMixin, nn.Module):
    """One sentence, two images: pooled(s, img0) ⊕ pooled(s, img1) -> Linear(2H, 2H) GELU LN Linear(2H, 2)."""

    config_class = LxmertConfig
    base_model_prefix = "lxmert."

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.config = cfg
        self.lxmert = Lxmert(cfg)
        h = cfg.hidden_size
        self.pair_head = ClassifierHead(2 * h, 2 * h, 2, cfg.layer_norm_eps)
        self.pair_head.apply(lambda m: init_weights(m, cfg.initializer_range))

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
        """Text (B, L); visual_feats (B, 2, N, D), visual_pos (B, 2, N, 4), visual mask (B, 2, N)."""
        check_image_pairs(visual_feats)
        out = self.lxmert(
            each_sentence_twice(input_ids),
            each_sentence_twice(attention_mask),
            each_sentence_twice(token_type_ids),
            image_rows(visual_feats),
            image_rows(visual_pos),
            image_rows(visual_attention_mask),
            output_attentions,
        )
        logits = self.pair_head(out.pooled_output.reshape(input_ids.shape[0], -1))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        regions = region_attention(out.attentions)
        if regions is not None:
            regions = regions.reshape(input_ids.shape[0], 2, -1)
        return ClassificationOutput(
            logits=logits, loss=loss, attentions=out.attentions, region_attention=regions
        )
