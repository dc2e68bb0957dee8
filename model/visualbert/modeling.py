"""`VisualBert`: text and projected region features in one BERT, as transformers' `VisualBertModel`.

The sequence is `[text (L)] [regions (N)]`; regions carry no box coordinates, only a projection of their
features plus a visual token-type (the config's `visual_token_type_id` for every region unless told
otherwise) and a visual position embedding (position 0 for every region unless told otherwise). One
LayerNorm covers both parts, one encoder reads them, the pooler reads token 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers.bert import BertEncoder
from ..layers.heads import Pooler
from ..layers.init import init_weights
from ..pretrained import PretrainedMixin
from .config import VisualBertConfig


@dataclass
class VisualBertOutput:
    """`sequence_output` (B, L + N, H): the L text states, then the N region states."""

    sequence_output: torch.Tensor
    pooled_output: torch.Tensor
    text_length: int
    attentions: tuple[torch.Tensor, ...] | None = None

    @property
    def text_output(self) -> torch.Tensor:
        return self.sequence_output[:, : self.text_length]

    @property
    def region_output(self) -> torch.Tensor:
        return self.sequence_output[:, self.text_length :]


class VisualBertEmbeddings(nn.Module):
    """Text: word + type + position. Regions: projection + visual type + visual position. Then LN, dropout."""

    def __init__(self, cfg: VisualBertConfig):
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.visual_token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.visual_position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.visual_projection = nn.Linear(cfg.visual_feat_dim, h)
        self.visual_token_type_id = cfg.visual_token_type_id

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        visual_feats: torch.Tensor,
        visual_token_type_ids: torch.Tensor | None,
        visual_position_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.position_embeddings.num_embeddings:
            raise ValueError(
                f"text of {length} tokens is longer than max_position_embeddings "
                f"{self.position_embeddings.num_embeddings}; truncate it"
            )
        words = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        text = words + self.position_embeddings.weight[:length]
        if token_type_ids is None:
            text = text + self.token_type_embeddings.weight[0]
        else:
            text = text + self.token_type_embeddings(token_type_ids)
        regions = self.visual_projection(visual_feats)
        if visual_token_type_ids is None:  # one type for every region: the checkpoint's convention
            regions = regions + self.visual_token_type_embeddings.weight[self.visual_token_type_id]
        else:
            regions = regions + self.visual_token_type_embeddings(visual_token_type_ids)
        if visual_position_ids is None:
            regions = regions + self.visual_position_embeddings.weight[0]
        else:
            regions = regions + self.visual_position_embeddings(visual_position_ids)
        return self.dropout(self.LayerNorm(torch.cat([text, regions], dim=1)))


class VisualBert(PretrainedMixin, nn.Module):
    """The VisualBERT backbone: embeddings, one BERT encoder, pooler."""

    config_class = VisualBertConfig
    base_model_prefix = ""

    def __init__(self, cfg: VisualBertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = VisualBertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = Pooler(cfg.hidden_size)
        self.apply(lambda m: init_weights(m, cfg.initializer_range))
        if cfg.special_visual_initialize:
            with torch.no_grad():
                emb = self.embeddings
                emb.visual_token_type_embeddings.weight.copy_(emb.token_type_embeddings.weight)
                emb.visual_position_embeddings.weight.copy_(emb.position_embeddings.weight)

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
        visual_token_type_ids: torch.Tensor | None = None,
        visual_position_ids: torch.Tensor | None = None,
    ) -> VisualBertOutput:
        """input_ids (B, L); attention_mask (B, L) 1 = token; visual_feats (B, N, D);
        visual_attention_mask (B, N) 1 = real region. `visual_pos` is accepted for the shared signature and
        ignored: VisualBERT embeds no box coordinates. Outputs at padding are computed but meaningless."""
        b, length = input_ids.shape
        if visual_feats is None:
            raise ValueError("VisualBERT needs visual_feats (B, N, D)")
        dim = self.config.visual_feat_dim
        if visual_feats.dim() != 3 or visual_feats.shape[0] != b or visual_feats.shape[-1] != dim:
            raise ValueError(
                f"visual_feats {tuple(visual_feats.shape)} should be (B={b}, N, visual_feat_dim={dim})"
            )
        n = visual_feats.shape[1]
        embeddings = self.embeddings(
            input_ids, token_type_ids, visual_feats, visual_token_type_ids, visual_position_ids, inputs_embeds
        )
        key_mask = None
        if attention_mask is not None or visual_attention_mask is not None:
            text_mask = input_ids.new_ones(b, length) if attention_mask is None else attention_mask
            region_mask = input_ids.new_ones(b, n) if visual_attention_mask is None else visual_attention_mask
            key_mask = torch.cat([text_mask.bool(), region_mask.bool()], dim=1)
        states, attentions = self.encoder(embeddings, key_mask, output_attentions)
        return VisualBertOutput(
            sequence_output=states,
            pooled_output=self.pooler(states),
            text_length=length,
            attentions=attentions,
        )
