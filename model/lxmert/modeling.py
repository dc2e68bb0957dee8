"""`Lxmert`: the language, object-relationship and cross-modality encoders with the [CLS] pooler."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import Rows
from ..layers.heads import Pooler
from ..layers.init import init_weights
from ..pretrained import PretrainedMixin
from .config import LxmertConfig
from .embeddings import ObjectEmbeddings, TextEmbeddings
from .encoders import CrossLayer, EncoderLayer


@dataclass
class LxmertOutput:
    """Final states; `attentions` holds, per cross layer, language->vision weights (B, heads, L, N)."""

    language_output: torch.Tensor
    vision_output: torch.Tensor
    pooled_output: torch.Tensor
    attentions: tuple[torch.Tensor, ...] | None = None


class Lxmert(PretrainedMixin, nn.Module):
    """The LXMERT backbone: text and object embeddings, 9 + 5 + 5 layers, pooler."""

    config_class = LxmertConfig
    base_model_prefix = ""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = TextEmbeddings(cfg)
        self.object_embeddings = ObjectEmbeddings(cfg)
        self.lang_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.l_layers))
        self.object_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.r_layers))
        self.cross_layers = nn.ModuleList(CrossLayer(cfg) for _ in range(cfg.x_layers))
        self.pooler = Pooler(cfg.hidden_size)
        self.apply(lambda m: init_weights(m, cfg.initializer_range))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        visual_feats: torch.Tensor | None = None,
        visual_pos: torch.Tensor | None = None,
        visual_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        inputs_embeds: torch.Tensor | None = None,
    ) -> LxmertOutput:
        """input_ids (B, L); attention_mask (B, L) 1 = token, 0 = padding; visual_feats (B, N, D);
        visual_pos (B, N, 4) boxes normalised to [0, 1]; visual_attention_mask (B, N) 1 = real box;
        inputs_embeds (B, L, H): word vectors to use instead of looking `input_ids` up.

        The encoders compute real tokens and boxes only: outputs at padding are zero."""
        self._check_inputs(input_ids, visual_feats, visual_pos)
        lang_layout = Rows(attention_mask, *input_ids.shape)
        if lang_layout.left_padded:
            raise ValueError(
                "attention_mask is 0 at position 0 of some row: the pooler reads the first token ([CLS]), "
                "and padding has no state here; pad on the right (tokenizer padding_side='right')"
            )
        vision_layout = Rows(visual_attention_mask, *visual_feats.shape[:2])
        lang = lang_layout.to_rows(self.embeddings(input_ids, token_type_ids, inputs_embeds))
        vision = vision_layout.to_rows(self.object_embeddings(visual_feats, visual_pos))
        for layer in self.lang_layers:
            lang = layer(lang, lang_layout)
        for layer in self.object_layers:
            vision = layer(vision, vision_layout)
        attentions = []
        for layer in self.cross_layers:
            lang, vision, probs = layer(lang, lang_layout, vision, vision_layout, output_attentions)
            attentions.append(probs)
        language_output = lang_layout.to_batch(lang)
        return LxmertOutput(
            language_output=language_output,
            vision_output=vision_layout.to_batch(vision),
            pooled_output=self.pooler(language_output),
            attentions=tuple(attentions) if output_attentions else None,
        )

    def _check_inputs(
        self, input_ids: torch.Tensor, visual_feats: torch.Tensor | None, visual_pos: torch.Tensor | None
    ) -> None:
        cfg = self.config
        if visual_feats is None or visual_pos is None:
            raise ValueError("LXMERT needs visual_feats (B, N, D) and visual_pos (B, N, 4)")
        if visual_feats.shape[-1] != cfg.visual_feat_dim or visual_pos.shape[-1] != cfg.visual_pos_dim:
            raise ValueError(
                f"visual_feats {tuple(visual_feats.shape)} / visual_pos {tuple(visual_pos.shape)} "
                f"do not end in "
                f"visual_feat_dim={cfg.visual_feat_dim} / visual_pos_dim={cfg.visual_pos_dim}"
            )
        if visual_feats.shape[:2] != visual_pos.shape[:2] or visual_feats.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"batch/box counts disagree: input_ids {tuple(input_ids.shape)}, "
                f"visual_feats {tuple(visual_feats.shape)}, visual_pos {tuple(visual_pos.shape)}"
            )
