"""The DALL-E transformer: one decoder-only stack over text tokens followed by image tokens (stage 2).

The sequence is `text_length` text tokens (a start token, the caption, then one learned padding token per
free position) and the image's grid * grid tokens in raster order. Position t predicts token t + 1, so the
last text position predicts the first image token. Text has its own positions; an image token's position is
its row's embedding plus its column's. Each layer's attention mask comes from `masks.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..pretrained import PretrainedMixin
from .config import DalleConfig
from .masks import attention_mask, layer_mask_kinds


class SelfAttention(nn.Module):
    def __init__(self, cfg: DalleConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(b, n, self.num_heads, d // self.num_heads).transpose(1, 2) for t in (q, k, v))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class MLP(nn.Module):
    def __init__(self, cfg: DalleConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.proj = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: DalleConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden_size)
        self.attn = SelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x), mask))
        return x + self.mlp(self.ln_2(x))


@dataclass
class DalleOutput:
    text_logits: torch.Tensor  # (B, text_length - 1, text_table_size): predictions of text tokens 1..
    image_logits: torch.Tensor  # (B, n + 1, image_vocab_size) for n image tokens in (at most grid^2)


@dataclass
class DalleLoss:
    loss: torch.Tensor  # text_loss_weight * text + image_loss_weight * image
    text: torch.Tensor  # mean cross-entropy over the batch's text predictions
    image: torch.Tensor  # mean cross-entropy over the batch's image tokens


class DalleTransformer(nn.Module, PretrainedMixin):
    config_class = DalleConfig
    base_model_prefix = ""

    def __init__(self, config: DalleConfig) -> None:
        super().__init__()
        cfg = self.config = config
        d = cfg.hidden_size
        self.text_embed = nn.Embedding(cfg.text_table_size, d)
        self.text_position = nn.Embedding(cfg.text_length, d)
        self.image_embed = nn.Embedding(cfg.image_vocab_size, d)
        self.image_row = nn.Embedding(cfg.image_grid, d)
        self.image_column = nn.Embedding(cfg.image_grid, d)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(d)
        self.text_head = nn.Linear(d, cfg.text_table_size, bias=False)
        self.image_head = nn.Linear(d, cfg.image_vocab_size, bias=False)

        # One mask per kind in use, over the longest input (the last image token is never an input).
        self.mask_kinds = layer_mask_kinds(cfg.attention, cfg.num_layers)
        length = cfg.text_length + cfg.image_length - 1
        for kind in sorted(set(self.mask_kinds)):
            mask = attention_mask(kind, cfg.text_length, cfg.image_grid, length, cfg.conv_kernel)
            self.register_buffer(f"mask_{kind}", mask, persistent=False)

        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1 / sqrt(2 * layers) so the stream's variance stays put.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.num_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def pad_text(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """Replace the `padding` (bool, B x text_length) positions of `ids` with each position's own
        padding token (the paper's learned per-position padding)."""
        cfg = self.config
        position_pad = cfg.text_vocab_size + torch.arange(cfg.text_length, device=ids.device)
        return torch.where(padding, position_pad.expand_as(ids), ids)

    def forward(self, text: torch.Tensor, image: torch.Tensor | None = None) -> DalleOutput:
        """`text` (B, text_length) ids; `image` (B, n) raster-order tokens, n <= grid^2 (None: n = 0)."""
        cfg = self.config
        b = text.shape[0]
        if text.shape[1] != cfg.text_length:
            raise ValueError(f"text has {text.shape[1]} positions; the model takes {cfg.text_length}")
        if image is None:
            image = text.new_zeros(b, 0)
        image = image[:, : cfg.image_length - 1]  # the last image token predicts nothing
        n = image.shape[1]
        rows = torch.arange(n, device=text.device) // cfg.image_grid
        cols = torch.arange(n, device=text.device) % cfg.image_grid
        x = torch.cat(
            [
                self.text_embed(text) + self.text_position.weight,
                self.image_embed(image) + self.image_row(rows) + self.image_column(cols),
            ],
            dim=1,
        )
        x = self.dropout(x)
        length = x.shape[1]
        for kind, block in zip(self.mask_kinds, self.blocks, strict=True):
            x = block(x, getattr(self, f"mask_{kind}")[:length, :length])
        x = self.ln_f(x)
        t = cfg.text_length
        return DalleOutput(
            text_logits=self.text_head(x[:, : t - 1]), image_logits=self.image_head(x[:, t - 1 :])
        )

    def loss(self, text: torch.Tensor, image: torch.Tensor) -> DalleLoss:
        """The paper's objective on a full batch: text (B, text_length), image (B, grid^2)."""
        cfg = self.config
        out = self(text, image)
        text_loss = F.cross_entropy(out.text_logits.flatten(0, 1), text[:, 1:].flatten())
        image_loss = F.cross_entropy(out.image_logits.flatten(0, 1), image.flatten())
        return DalleLoss(
            loss=cfg.text_loss_weight * text_loss + cfg.image_loss_weight * image_loss,
            text=text_loss,
            image=image_loss,
        )

    @torch.no_grad()
    def generate(
        self,
        text: torch.Tensor,
        top_k: int | None = None,
        top_p: float | None = None,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        guidance: float = 1.0,
        unconditional: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sample (B, grid^2) image tokens after `text`, one token at a time. With `guidance` s != 1 and
        `unconditional` text ids (1 or B rows: the empty caption), each step samples from the
        classifier-free guided logits u + s (c - u) of the conditional c and unconditional u next-token
        logits (Ho & Salimans 2022, as autoregressive text-to-image models use it); s = 1 is plain
        sampling, s = 0 ignores the prompt."""
        b = text.shape[0]
        guided = guidance != 1.0
        if guided:
            if unconditional is None:
                raise ValueError("guidance needs the unconditional (empty caption) text")
            text = torch.cat([text, unconditional.expand(b, -1)])
        image = text.new_zeros(b, 0)
        for _ in range(self.config.image_length):
            context = torch.cat([image, image]) if guided else image
            logits = self(text, context).image_logits[:, -1].float()
            if guided:
                conditional, free = logits[:b], logits[b:]
                logits = free + guidance * (conditional - free)
            token = sample_token(logits / temperature, top_k, top_p, generator)
            image = torch.cat([image, token[:, None]], dim=1)
        return image


def sample_token(
    logits: torch.Tensor, top_k: int | None, top_p: float | None, generator: torch.Generator | None
) -> torch.Tensor:
    """One draw per row from softmax(logits) restricted to the top k and the nucleus of mass top_p."""
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Keep each token whose preceding mass is below top_p (the most likely one always survives).
        drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
