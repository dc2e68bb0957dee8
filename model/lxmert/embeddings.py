"""Input embeddings: WordPiece tokens with positions and types, and detected objects with their boxes."""

from __future__ import annotations

import torch
from torch import nn

from ..layers.dropout import Dropout
from .config import LxmertConfig


class TextEmbeddings(nn.Module):
    """word + position + token type -> LN -> dropout.

    Unlike the release, no row has `padding_idx`: the position of [CLS] and token type 0 get gradients.
    """

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds` (B, L, H), when given, stands in for the word rows of `input_ids`."""
        length = input_ids.shape[1]
        if length > self.position.num_embeddings:
            raise ValueError(
                f"text of {length} tokens is longer than max_position_embeddings "
                f"{self.position.num_embeddings}; truncate it"
            )
        words = self.word(input_ids) if inputs_embeds is None else inputs_embeds
        x = words + self.position.weight[:length]
        if token_type_ids is None:
            x = x + self.token_type.weight[0]
        else:
            x = x + self.token_type(token_type_ids)
        return self.dropout(self.norm(x))


class ObjectEmbeddings(nn.Module):
    """`(LN(W_f f) + LN(W_p p)) / 2` -> dropout; objects are a set, so no index embedding."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.feat_proj = nn.Linear(cfg.visual_feat_dim, cfg.hidden_size)
        self.feat_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.box_proj = nn.Linear(cfg.visual_pos_dim, cfg.hidden_size)
        self.box_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def forward(self, visual_feats: torch.Tensor, visual_pos: torch.Tensor) -> torch.Tensor:
        x = self.feat_norm(self.feat_proj(visual_feats)) + self.box_norm(self.box_proj(visual_pos))
        return self.dropout(x / 2)
