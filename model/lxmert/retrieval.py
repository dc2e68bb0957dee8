"""`LxmertForRetrieval`: caption-image scores from the pre-training matching head (`match_head`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.init import init_weights
from ..outputs import ClassificationOutput
from ..pretrained import PretrainedMixin
from .config import LxmertConfig
from .finetuning import region_attention
from .modeling import Lxmert


class LxmertForRetrieval(PretrainedMixin, nn.Module):
    """The matching head of pre-training (`match_head`, loaded by name from a pre-training directory)
    scores a caption-image pair as the log-odds of "matched": logit[1] - logit[0].

    With K candidate images per caption, visual inputs (B, K, N, ·), logits (B, K) and labels (B,) the
    true image's index: cross-entropy over the candidates. With one image per caption, visual inputs
    (B, N, ·), logits (B, 1) and labels (B,) 1 = match: the matching head's own two-way cross-entropy."""

    config_class = LxmertConfig
    base_model_prefix = "lxmert."

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.config = cfg
        self.lxmert = Lxmert(cfg)
        self.match_head = nn.Linear(cfg.hidden_size, 2)
        self.match_head.apply(lambda m: init_weights(m, cfg.initializer_range))

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
        if visual_feats is None or visual_feats.dim() not in (3, 4):
            shape = None if visual_feats is None else tuple(visual_feats.shape)
            raise ValueError(f"retrieval expects visual_feats (B, N, D) or (B, K, N, D), got {shape}")
        pairs = visual_feats.dim() == 3
        k = 1 if pairs else visual_feats.shape[1]
        text = (input_ids, attention_mask, token_type_ids)
        visual = (visual_feats, visual_pos, visual_attention_mask)
        if not pairs:  # row i * K + j: caption i with its candidate j
            text = tuple(None if x is None else x.repeat_interleave(k, dim=0) for x in text)
            visual = tuple(None if x is None else x.flatten(0, 1) for x in visual)
        out = self.lxmert(*text, *visual, output_attentions)
        match = self.match_head(out.pooled_output)
        logits = (match[:, 1] - match[:, 0]).view(-1, k)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(match if pairs else logits, labels)
        regions = region_attention(out.attentions)
        if regions is not None and not pairs:
            regions = regions.view(-1, k, regions.shape[-1])
        return ClassificationOutput(
            logits=logits, loss=loss, attentions=out.attentions, region_attention=regions
        )
