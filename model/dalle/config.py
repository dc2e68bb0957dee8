"""`DVAEConfig` and `DalleConfig`: the image tokenizer's and the transformer's sizes, with named presets."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..presets import PresetConfig

ATTENTION_KINDS = ("dense", "sparse")
RECONSTRUCTION_LOSSES = ("logit-laplace", "mse")


@dataclass
class DVAEConfig(PresetConfig):
    """The discrete VAE (SPEC §9, stage 1): a ResNet encoder to a grid of codebook logits, a ResNet
    decoder from a relaxed one-hot grid to logit-Laplace pixel statistics."""

    FAMILY: ClassVar[str] = "dalle-dvae"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # Ramesh et al. 2021, appendix A: 256 x 256 -> 32 x 32 tokens of 8192, n_hid 256, 2 blocks per group,
        # tau 1 -> 1/16 over 150k updates, beta 0 -> 6.6 over 5k updates.
        "paper": {},
        # 64 x 64 -> 8 x 8 tokens: trains on 2 CPU cores in minutes. At the first budget (600 steps of 16
        # images) the paper's recipe collapses onto a few codes that drop the objects' colours; what keeps
        # them is the encoder's logits scaled by 10, squared error without the KL term, and a plain
        # softmax annealed to one-hot (1000 demo scenes, 600 steps: the colour of 95 % of held-out objects
        # kept, 19.6 dB; with the paper's relaxation: 0 %, 16.5 dB). With the Gumbel noise kept, one run
        # kept 100 % and another collapsed onto 4 codes (see BENCHMARKS.md).
        "small": {
            "image_size": 64,
            "codebook_size": 512,
            "hidden_size": 32,
            "blocks_per_group": 1,
            "temperature_anneal_steps": 600,
            "kl_anneal_steps": 600,
            "kl_weight": 0.0,
            "gumbel_noise": 0.0,
            "logit_scale": 10.0,
            "reconstruction_loss": "mse",
        },
    }

    image_size: int = 256
    channels: int = 3
    codebook_size: int = 8192
    downsample: int = 8  # a power of two: one ResNet group per halving, plus one at full size
    hidden_size: int = 256  # width of the first group; each later group doubles it (the paper's n_hid)
    blocks_per_group: int = 2
    # Gumbel-softmax temperature, cosine-annealed from start to end over the steps (then held).
    temperature_start: float = 1.0
    temperature_end: float = 1.0 / 16
    temperature_anneal_steps: int = 150_000
    # KL weight beta against the uniform prior, cosine-raised from 0 to `kl_weight` over the steps.
    kl_weight: float = 6.6
    kl_anneal_steps: int = 5_000
    # Pixels are mapped into (eps, 1 - eps) so the logit-Laplace density is finite (openai/DALL-E map_pixels).
    logit_laplace_eps: float = 0.1
    # "logit-laplace": the paper's likelihood. "mse": squared error of decoded pixels (the small preset's:
    # with a learned scale the logit-Laplace decoder raises its uncertainty on the small coloured objects
    # instead of drawing them, and even an unquantised bottleneck then reconstructs them grey).
    reconstruction_loss: str = "logit-laplace"
    # Scale of the Gumbel noise added to the logits in training: 1 is the paper's Gumbel-softmax; 0 anneals
    # a plain softmax of the logits to one-hot with the temperature (deterministic relaxation).
    gumbel_noise: float = 1.0
    # The encoder's logits are multiplied by this: above 1, the relaxed codes differ between inputs from
    # the first step (at 1 with 512 codes they start near uniform and few codes ever win).
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.downsample < 1 or self.downsample & (self.downsample - 1):
            raise ValueError(f"downsample {self.downsample} must be a power of two")
        if self.image_size % self.downsample:
            raise ValueError(
                f"image_size {self.image_size} must be a multiple of downsample {self.downsample}"
            )
        if self.codebook_size < 2:
            raise ValueError(f"codebook_size {self.codebook_size} must be at least 2")
        if self.hidden_size % 4:
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of 4 (blocks narrow by 4)")
        if not 0 < self.temperature_end <= self.temperature_start:
            raise ValueError(
                f"temperatures must satisfy 0 < end {self.temperature_end} <= start {self.temperature_start}"
            )
        if self.reconstruction_loss not in RECONSTRUCTION_LOSSES:
            raise ValueError(
                f"reconstruction_loss {self.reconstruction_loss!r} must be one of {RECONSTRUCTION_LOSSES}"
            )
        if not 0.0 < self.logit_laplace_eps < 0.5:
            raise ValueError(f"logit_laplace_eps {self.logit_laplace_eps} must lie in (0, 0.5)")

    @property
    def num_groups(self) -> int:
        return int(math.log2(self.downsample)) + 1

    @property
    def grid_size(self) -> int:
        """Tokens per side of an image."""
        return self.image_size // self.downsample


@dataclass
class DalleConfig(PresetConfig):
    """The decoder-only transformer over text tokens then image tokens (SPEC §9, stage 2)."""

    FAMILY: ClassVar[str] = "dalle"
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        # Ramesh et al. 2021: 64 layers, 62 heads of 64 (width 3968), 256 BPE tokens of 16384, 32 x 32 image
        # tokens of 8192, sparse attention. A configuration: 12B parameters do not train here.
        "paper": {},
        # For the small dVAE preset (8 x 8 tokens of 512) and short captions.
        "small": {
            "text_vocab_size": 1000,
            "text_length": 24,
            "image_vocab_size": 512,
            "image_grid": 8,
            "num_layers": 4,
            "num_heads": 4,
            "hidden_size": 128,
            "conv_kernel": 5,
            "dropout": 0.0,
        },
    }

    text_vocab_size: int = 16384
    text_length: int = 256  # text positions, the caption then one learned padding token per free position
    image_vocab_size: int = 8192  # the dVAE's codebook size
    image_grid: int = 32  # image tokens per side
    num_layers: int = 64
    num_heads: int = 62
    hidden_size: int = 3968
    dropout: float = 0.0
    # "dense": every layer causal over the whole sequence. "sparse": the paper's row / column masks, with
    # the convolutional mask in the last layer (image tokens still see all text).
    attention: str = "dense"
    conv_kernel: int = 11
    # Loss weights on the mean text and mean image cross-entropies (the paper's 1/8 and 7/8).
    text_loss_weight: float = 1.0 / 8
    image_loss_weight: float = 7.0 / 8

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention {self.attention!r} must be one of {ATTENTION_KINDS}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}"
            )
        if self.text_length < 2:
            raise ValueError(f"text_length {self.text_length} must be at least 2 (a start token and a word)")
        if self.conv_kernel < 1 or self.conv_kernel % 2 == 0:
            raise ValueError(f"conv_kernel {self.conv_kernel} must be odd and positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout {self.dropout} must lie in [0, 1)")

    @property
    def image_length(self) -> int:
        return self.image_grid * self.image_grid

    @property
    def text_table_size(self) -> int:
        """Text vocabulary plus one padding token per text position (the paper's learned padding)."""
        return self.text_vocab_size + self.text_length
