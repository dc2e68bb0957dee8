"""`Vilbert`: the two-stream backbone (embeddings, encoder, `t_pooler`/`v_pooler`) and its fused output."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.layers.attention import static_layout_on
from model.layers.init import init_weights
from model.pretrained import PretrainedMixin

from .config import VilbertConfig
from .embeddings import ImageEmbeddings, TextEmbeddings, with_global_region
from .encoder import Encoder


@dataclass
class VilbertOutput:
    """Final states. `vision_output` and the co-attention weights include the global image token at
    region index 0; `co_attentions` holds, per co-attention layer, (text->vision (B, h, L, N + 1),
    vision->text (B, h, N + 1, L)) weights; `pooled_output` is the fusion of the two pooled vectors."""

    text_output: torch.Tensor
    vision_output: torch.Tensor
    pooled_text: torch.Tensor
    pooled_vision: torch.Tensor
    pooled_output: torch.Tensor
    vision_mask: torch.Tensor
    co_attentions: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None


def _without_task_token(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Drops text position 1 (the task token) along `dim`."""
    return torch.cat([x.narrow(dim, 0, 1), x.narrow(dim, 2, x.shape[dim] - 2)], dim=dim)


class Pooler(nn.Module):
    """`relu(dense(h[0]))` into the shared `bi_hidden_size` space."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.dense = nn.Linear(in_dim, out_dim)

    def forward(self, sequence: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.dense(sequence[:, 0]))


class Vilbert(PretrainedMixin, nn.Module):
    """The ViLBERT backbone (vilbert-multi-task's `BertModel`, saved under `bert.` by the head classes)."""

    config_class = VilbertConfig
    base_model_prefix = ""

    def __init__(self, cfg: VilbertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = TextEmbeddings(cfg)
        self.v_embeddings = ImageEmbeddings(cfg)
        self.encoder = Encoder(cfg)
        self.t_pooler = Pooler(cfg.hidden_size, cfg.bi_hidden_size)
        self.v_pooler = Pooler(cfg.v_hidden_size, cfg.bi_hidden_size)
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
        image_feats: torch.Tensor | None = None,
    ) -> VilbertOutput:
        """input_ids (B, L) starting with [CLS]; attention_mask (B, L) 1 = token; visual_feats (B, N, D);
        visual_pos (B, N, 4) boxes normalised to [0, 1]; visual_attention_mask (B, N) 1 = real region;
        image_feats (B, D) the global token's feature (default: the mean of the real regions)."""
        self._check_inputs(input_ids, visual_feats, visual_pos)
        b, length = input_ids.shape
        if attention_mask is None:
            attention_mask = input_ids.new_ones(b, length)
        elif not static_layout_on() and not bool(attention_mask[:, 0].all()):  # no host sync when compiled
            raise ValueError(
                "attention_mask is 0 at position 0 of some row: the text pooler reads the first token "
                "([CLS]); pad on the right (tokenizer padding_side='right')"
            )
        feats, locations, vision_mask = with_global_region(
            visual_feats, visual_pos, visual_attention_mask, image_feats
        )
        text = self.embeddings(input_ids, token_type_ids, inputs_embeds)
        text_mask = attention_mask.bool()
        task = self.config.task_token is not None
        if task:
            text_mask = torch.cat([text_mask[:, :1], text_mask], dim=1)
        vision = self.v_embeddings(feats, locations)
        text, vision, co_probs = self.encoder(
            text, text_mask[:, None, None, :], vision, vision_mask.bool()[:, None, None, :], output_attentions
        )
        if task:  # the task token's state is no caller's business: give back (B, L)
            text = _without_task_token(text, 1)
            co_probs = [(_without_task_token(t2v, 2), _without_task_token(v2t, 3)) for t2v, v2t in co_probs]
        pooled_text, pooled_vision = self.t_pooler(text), self.v_pooler(vision)
        if self.config.fusion_method == "mul":
            pooled = pooled_text * pooled_vision
        else:
            pooled = pooled_text + pooled_vision
        return VilbertOutput(
            text_output=text,
            vision_output=vision,
            pooled_text=pooled_text,
            pooled_vision=pooled_vision,
            pooled_output=pooled,
            vision_mask=vision_mask,
            co_attentions=tuple(co_probs) if output_attentions else None,
        )

    def _check_inputs(
        self, input_ids: torch.Tensor, visual_feats: torch.Tensor | None, visual_pos: torch.Tensor | None
    ) -> None:
        cfg = self.config
        if visual_feats is None or visual_pos is None:
            raise ValueError("ViLBERT needs visual_feats (B, N, D) and visual_pos (B, N, 4)")
        if visual_feats.shape[-1] != cfg.visual_feat_dim or visual_pos.shape[-1] != 4:
            raise ValueError(
                f"visual_feats {tuple(visual_feats.shape)} / visual_pos {tuple(visual_pos.shape)} do not end "
                f"in visual_feat_dim={cfg.visual_feat_dim} / 4 (normalised x1, y1, x2, y2)"
            )
        if visual_feats.shape[:2] != visual_pos.shape[:2] or visual_feats.shape[0] != input_ids.shape[0]:
            raise ValueError(
                f"batch/region counts disagree: input_ids {tuple(input_ids.shape)}, "
                f"visual_feats {tuple(visual_feats.shape)}, visual_pos {tuple(visual_pos.shape)}"
            )
