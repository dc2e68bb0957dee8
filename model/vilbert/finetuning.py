"""Fine-tuning models: VQA/GQA answers, the NLVR2 image pair and caption-image retrieval scores."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.layers.dropout import Dropout
from model.layers.heads import soft_score_loss
from model.layers.init import init_weights
from model.outputs import ClassificationOutput
from model.pretrained import PretrainedMixin

from .config import VilbertConfig
from .heads import SimpleClassifier
from .modeling import Vilbert, VilbertOutput


def cls_region_attention(out: VilbertOutput) -> torch.Tensor | None:
    """(B, N) weights of text position 0 over the regions in the last co-attention layer."""
    if not out.co_attentions:
        return None
    text_to_vision = out.co_attentions[-1][0]  # (B, heads, L, N + 1)
    return text_to_vision[:, :, 0, 1:].mean(dim=1)


class _Head(PretrainedMixin, nn.Module):
    """Backbone under `bert`, dropout on the fused pooled output (the release's `dropout`), one head."""

    config_class = VilbertConfig
    base_model_prefix = "bert."

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        self.config = cfg
        self.bert = Vilbert(cfg)
        self.dropout = Dropout(cfg.classifier_dropout_prob)

    def _init_heads(self, *heads: nn.Module) -> None:
        for head in heads:
            head.apply(lambda m: init_weights(m, self.config.initializer_range))

    def _per_image(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        token_type_ids: torch.Tensor | None,
        visual_feats: torch.Tensor | None,
        visual_pos: torch.Tensor | None,
        visual_attention_mask: torch.Tensor | None,
        output_attentions: bool,
        what: str,
    ) -> tuple[VilbertOutput, int]:
        """Runs each sentence against each of its K images: visual inputs (B, K, N, ·) -> rows B x K."""
        if visual_feats is None or visual_feats.dim() != 4:
            shape = None if visual_feats is None else tuple(visual_feats.shape)
            raise ValueError(f"{what} expects visual_feats of shape (B, K, N, D), got {shape}")
        k = visual_feats.shape[1]

        def repeat(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.repeat_interleave(k, dim=0)

        def flat(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.flatten(0, 1)

        out = self.bert(
            repeat(input_ids),
            repeat(attention_mask),
            repeat(token_type_ids),
            flat(visual_feats),
            flat(visual_pos),
            flat(visual_attention_mask),
            output_attentions,
        )
        return out, k


def _unflatten(x: torch.Tensor | None, k: int) -> torch.Tensor | None:
    return None if x is None else x.view(-1, k, *x.shape[1:])


class VilbertForQuestionAnswering(_Head):
    """Fused pooled output -> `vil_prediction` SimpleClassifier(bi, 2 bi, A); soft-score BCE x A."""

    def __init__(self, cfg: VilbertConfig, num_answers: int):
        super().__init__(cfg)
        self.num_answers = num_answers
        bi = cfg.bi_hidden_size
        self.vil_prediction = SimpleClassifier(bi, 2 * bi, num_answers, cfg.layer_norm_eps)
        self._init_heads(self.vil_prediction)

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
        """labels (B, A): soft answer scores in [0, 1]."""
        out = self.bert(
            input_ids,
            attention_mask,
            token_type_ids,
            visual_feats,
            visual_pos,
            visual_attention_mask,
            output_attentions,
        )
        logits = self.vil_prediction(self.dropout(out.pooled_output))
        loss = None
        if labels is not None:
            loss = soft_score_loss(logits, labels)
        return ClassificationOutput(logits, loss, out.co_attentions, cls_region_attention(out))


class VilbertForNLVR2(_Head):
    """One sentence, two images: fused(s, img0) ⊕ fused(s, img1) -> `vil_binary_prediction`
    SimpleClassifier(2 bi, 2 bi, 2); cross-entropy."""

    def __init__(self, cfg: VilbertConfig):
        super().__init__(cfg)
        bi = cfg.bi_hidden_size
        self.vil_binary_prediction = SimpleClassifier(2 * bi, 2 * bi, 2, cfg.layer_norm_eps)
        self._init_heads(self.vil_binary_prediction)

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
        out, k = self._per_image(
            input_ids,
            attention_mask,
            token_type_ids,
            visual_feats,
            visual_pos,
            visual_attention_mask,
            output_attentions,
            "NLVR2",
        )
        if k != 2:
            raise ValueError(f"NLVR2 takes two images per sentence, got {k}")
        pooled = self.dropout(out.pooled_output).reshape(input_ids.shape[0], -1)
        logits = self.vil_binary_prediction(pooled)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ClassificationOutput(logits, loss, out.co_attentions, _unflatten(cls_region_attention(out), k))


class VilbertForRetrieval(_Head):
    """Caption-image matching scores from `vil_logit` Linear(bi, 1). With K candidate images per caption,
    visual inputs (B, K, N, ·), logits (B, K) and labels (B,) the true image's index: cross-entropy over the
    candidates (the release trains 1 positive + 3 negatives). With one image per caption, visual inputs
    (B, N, ·), logits (B, 1) and labels (B,) 1 = match: binary cross-entropy."""

    def __init__(self, cfg: VilbertConfig):
        super().__init__(cfg)
        self.vil_logit = nn.Linear(cfg.bi_hidden_size, 1)
        self._init_heads(self.vil_logit)

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
        visual = (input_ids, attention_mask, token_type_ids, visual_feats, visual_pos, visual_attention_mask)
        if visual_feats is not None and visual_feats.dim() == 3:
            out = self.bert(*visual, output_attentions)
            logits = self.vil_logit(self.dropout(out.pooled_output))
            loss = None
            if labels is not None:
                loss = F.binary_cross_entropy_with_logits(logits[:, 0], labels.to(logits.dtype))
            return ClassificationOutput(logits, loss, out.co_attentions, cls_region_attention(out))
        out, k = self._per_image(*visual, output_attentions, "retrieval")
        logits = self.vil_logit(self.dropout(out.pooled_output)).view(-1, k)
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ClassificationOutput(logits, loss, out.co_attentions, _unflatten(cls_region_attention(out), k))
