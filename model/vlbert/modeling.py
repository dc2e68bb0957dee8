"""`VlBert`: words and regions in one BERT, each token carrying a linguistic and a visual embedding.

Sequence: `[text (L)] [whole image] [regions (N)] [END]`. Every token's input is the sum of a linguistic
embedding, a visual feature embedding, a segment (A text, B answer, C visual) and a position:

- words: their word piece + the whole-image RoI's visual embedding (through `visual_ln_text`);
- the whole image and each region: the [IMG] embedding + its own visual embedding (`visual_ln_object`),
  all at one shared position, right after the text; the whole image is the first RoI, as in the
  release (its appearance is the mean of the region features, its box the image);
- [END]: its own embedding, at the position after that.

A RoI's visual embedding is `ReLU(Linear(Dropout([geometry ; appearance])))`. Both visual LayerNorms
start with zero weights, so training starts from BERT's text-only input. Padding may sit anywhere
(text on the right, regions after the real ones): keys at padding are masked, and a position depends
only on the real text length, so the real outputs equal those of the release's packed layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..layers.attention import static_layout_on
from ..layers.bert import BertEncoder
from ..layers.init import init_weights
from ..pretrained import PretrainedMixin
from .config import VlBertConfig
from .geometry import box_geometry, release_boxes

VISUAL_SEGMENT = 2


@dataclass
class VlBertOutput:
    """`sequence_output` (B, L + N + 2, H) in the layout above."""

    sequence_output: torch.Tensor
    text_length: int
    num_regions: int
    attentions: tuple[torch.Tensor, ...] | None = None

    @property
    def text_output(self) -> torch.Tensor:
        return self.sequence_output[:, : self.text_length]

    @property
    def region_output(self) -> torch.Tensor:
        """(B, N, H): the regions' states (not the whole image's)."""
        start = self.text_length + 1
        return self.sequence_output[:, start : start + self.num_regions]


class VlBert(PretrainedMixin, nn.Module):
    """The VL-BERT backbone (`vlbert.*` of the release, with its visual feature embedding)."""

    config_class = VlBertConfig
    takes_image_size = True  # the pipelines pass `image_size` (pipelines.data.regions.inputs_for)
    base_model_prefix = ""

    def __init__(self, cfg: VlBertConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.end_embedding = nn.Embedding(1, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embedding_LayerNorm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.embedding_dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.visual_ln_text = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.visual_ln_object = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.object_linguistic_embeddings = nn.Embedding(1, h)  # [IMG]
        self.obj_downsample = nn.Sequential(
            nn.Dropout(cfg.visual_dropout_prob),
            nn.Linear(cfg.geometry_dim + cfg.visual_feat_dim, h),
            nn.ReLU(),
        )
        self.encoder = BertEncoder(cfg)
        self.apply(lambda m: init_weights(m, cfg.initializer_range))
        with torch.no_grad():
            self.visual_ln_text.weight.zero_()
            self.visual_ln_object.weight.zero_()

    def visual_embeddings(self, feats: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        """(B, K, D) appearance and (B, K, 4) normalised boxes -> (B, K, H)."""
        return self.obj_downsample(torch.cat([box_geometry(boxes, self.config.geometry_dim), feats], -1))

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
        region_words: torch.Tensor | None = None,
        image_size: torch.Tensor | None = None,
    ) -> VlBertOutput:
        """input_ids (B, L) padded on the right; attention_mask (B, L); visual_feats (B, N, D); visual_pos
        (B, N, 4) boxes normalised to [0, 1]; visual_attention_mask (B, N) 1 = real region.
        image_feats (B, D): the whole image's appearance (default: the mean of the real regions');
        region_words (B, N, H): the regions' linguistic embeddings (default: [IMG]);
        image_size (B, 2): the images' (width, height) in pixels, for the release's whole-image box and
        clamping (`release_boxes`); without it the whole image is [0, 0, 1, 1]."""
        b, length = input_ids.shape
        text_mask, region_mask = self._check_inputs(
            input_ids, attention_mask, visual_feats, visual_pos, visual_attention_mask
        )
        n = visual_feats.shape[1]
        if length + 2 > self.config.max_position_embeddings:
            raise ValueError(
                f"text of {length} tokens leaves no position for the regions and [END] within "
                f"max_position_embeddings {self.config.max_position_embeddings}; truncate it"
            )
        if image_feats is None:
            weight = region_mask[..., None].to(visual_feats.dtype)
            image_feats = (visual_feats * weight).sum(1) / weight.sum(1).clamp(min=1)
        whole, visual_pos = release_boxes(visual_pos, image_size)
        visual = self.visual_embeddings(
            torch.cat([image_feats[:, None], visual_feats], 1), torch.cat([whole, visual_pos], 1)
        )  # (B, 1 + N, H)

        words = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        text = words + self.visual_ln_text(visual[:, :1])
        img = self.object_linguistic_embeddings.weight[0].expand(b, 1 + n, -1)
        if region_words is not None:
            img = torch.cat([img[:, :1], region_words], 1)
        objects = img + self.visual_ln_object(visual)
        end = self.end_embedding.weight[0].expand(b, 1, -1)
        x = torch.cat([text, objects, end], 1)

        text_length = text_mask.sum(1, keepdim=True)
        positions = torch.cat(
            [
                torch.arange(length, device=input_ids.device).expand(b, -1),
                text_length.expand(b, 1 + n),
                text_length + 1,
            ],
            1,
        )
        types = input_ids.new_zeros(b, length) if token_type_ids is None else token_type_ids
        types = torch.cat([types, types.new_full((b, n + 2), VISUAL_SEGMENT)], 1)
        x = x + self.position_embeddings(positions) + self.token_type_embeddings(types)
        x = self.embedding_dropout(self.embedding_LayerNorm(x))

        ones = text_mask.new_ones(b, 1)
        key_mask = torch.cat([text_mask, ones, region_mask, ones], 1)
        states, attentions = self.encoder(x, key_mask, output_attentions)
        return VlBertOutput(sequence_output=states, text_length=length, num_regions=n, attentions=attentions)

    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        visual_feats: torch.Tensor | None,
        visual_pos: torch.Tensor | None,
        visual_attention_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(text mask, region mask) as booleans, after checking shapes and right padding."""
        cfg = self.config
        if visual_feats is None or visual_pos is None:
            raise ValueError("VL-BERT needs visual_feats (B, N, D) and visual_pos (B, N, 4)")
        b = input_ids.shape[0]
        if (
            visual_feats.dim() != 3
            or visual_feats.shape[0] != b
            or visual_feats.shape[-1] != cfg.visual_feat_dim
            or visual_pos.shape != (*visual_feats.shape[:2], 4)
        ):
            raise ValueError(
                f"visual_feats {tuple(visual_feats.shape)} / visual_pos {tuple(visual_pos.shape)} should be "
                f"(B={b}, N, visual_feat_dim={cfg.visual_feat_dim}) / (B, N, 4)"
            )
        text_mask = (
            torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        )
        # not inside a compiled step (static layout), where asking the device would stop the graph
        if not static_layout_on() and bool((text_mask[:, 1:] & ~text_mask[:, :-1]).any()):
            raise ValueError(
                "attention_mask has a token after padding: VL-BERT places the regions at the position after "
                "the text, so pad on the right (tokenizer padding_side='right')"
            )
        region_mask = (
            torch.ones(visual_feats.shape[:2], dtype=torch.bool, device=visual_feats.device)
            if visual_attention_mask is None
            else visual_attention_mask.bool()
        )
        return text_mask, region_mask
