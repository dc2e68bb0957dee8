"""Fine-tuning models: VQA/GQA answer classification and the NLVR2 image-pair classifier (SPEC §2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.heads import ClassifierHead
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
            loss = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype)) * logits.shape[-1]
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
        if visual_feats is None or visual_feats.dim() != 4 or visual_feats.shape[1] != 2:
            shape = None if visual_feats is None else tuple(visual_feats.shape)
            raise ValueError(f"NLVR2 expects visual_feats of shape (B, 2, N, D), got {shape}")

        def twice(x: torch.Tensor | None) -> torch.Tensor | None:
            # Row 2i pairs sentence i with img0, row 2i+1 with img1.
            return None if x is None else x.repeat_interleave(2, dim=0)

        def pairs(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.flatten(0, 1)

        out = self.lxmert(
            twice(input_ids),
            twice(attention_mask),
            twice(token_type_ids),
            pairs(visual_feats),
            pairs(visual_pos),
            pairs(visual_attention_mask),
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
