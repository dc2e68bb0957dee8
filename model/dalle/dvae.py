"""The discrete VAE that turns an image into a grid of codebook tokens and back (DALL-E stage 1).

Encoder and decoder follow openai/DALL-E: groups of bottleneck ResNet blocks whose residual branch is
scaled by 1 / (number of blocks)^2, max-pooling (encoder) or nearest upsampling (decoder) between groups.
Training relaxes the token grid with Gumbel-softmax; the reconstruction term is the logit-Laplace
likelihood (or squared error, an option) and the KL term is against the uniform prior over the codebook.
The paper preset is that recipe; the small preset relaxes without the Gumbel noise (a softmax annealed to
one-hot), scales the logits and uses squared error without the KL term (see DVAEConfig: at its budget the
paper's recipe drops the objects' colours).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..pretrained import PretrainedMixin
from .config import DVAEConfig


def map_pixels(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[0, 1] pixels into (eps, 1 - eps), where the logit-Laplace density is finite."""
    return (1 - 2 * eps) * x + eps


def unmap_pixels(x: torch.Tensor, eps: float) -> torch.Tensor:
    return ((x - eps) / (1 - 2 * eps)).clamp(0, 1)


def cosine_anneal(step: int, start: float, end: float, steps: int) -> float:
    """`start` at step 0 to `end` at `steps` along half a cosine, then `end`."""
    if steps <= 0:
        return end
    progress = min(step, steps) / steps
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * progress))


class ResBlock(nn.Module):
    """Identity (or 1x1 projection) plus a gained 4-conv bottleneck branch of width out / 4."""

    def __init__(self, n_in: int, n_out: int, post_gain: float, kernels: tuple[int, int, int, int]) -> None:
        super().__init__()
        hidden = n_out // 4
        self.id_path = nn.Conv2d(n_in, n_out, 1) if n_in != n_out else nn.Identity()
        widths = (n_in, hidden, hidden, hidden, n_out)
        layers: list[nn.Module] = []
        for i, k in enumerate(kernels):
            layers += [nn.ReLU(), nn.Conv2d(widths[i], widths[i + 1], k, padding=k // 2)]
        self.res_path = nn.Sequential(*layers)
        self.post_gain = post_gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.id_path(x) + self.post_gain * self.res_path(x)


class Encoder(nn.Module):
    """Image (B, C, H, W) -> codebook logits (B, K, H / d, W / d)."""

    def __init__(self, cfg: DVAEConfig) -> None:
        super().__init__()
        post_gain = 1 / (cfg.num_groups * cfg.blocks_per_group) ** 2
        self.input = nn.Conv2d(cfg.channels, cfg.hidden_size, 7, padding=3)
        groups: list[nn.Module] = []
        n_in = cfg.hidden_size
        for g in range(cfg.num_groups):
            n_out = cfg.hidden_size * 2**g
            blocks = [
                ResBlock(n_in if b == 0 else n_out, n_out, post_gain, (3, 3, 3, 1))
                for b in range(cfg.blocks_per_group)
            ]
            if g < cfg.num_groups - 1:
                blocks.append(nn.MaxPool2d(2))
            groups.append(nn.Sequential(*blocks))
            n_in = n_out
        self.groups = nn.Sequential(*groups)
        self.output = nn.Sequential(nn.ReLU(), nn.Conv2d(n_in, cfg.codebook_size, 1))
        self.logit_scale = cfg.logit_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.groups(self.input(x))) * self.logit_scale


class Decoder(nn.Module):
    """(Relaxed) one-hot grid (B, K, h, w) -> pixel statistics (B, 2C, h * d, w * d): logit-Laplace
    location in the first C channels, log scale in the last C."""

    def __init__(self, cfg: DVAEConfig) -> None:
        super().__init__()
        post_gain = 1 / (cfg.num_groups * cfg.blocks_per_group) ** 2
        # The 1x1 input conv is the codebook: a one-hot token selects its column.
        n_in = cfg.hidden_size // 2
        self.input = nn.Conv2d(cfg.codebook_size, n_in, 1)
        groups: list[nn.Module] = []
        for g in reversed(range(cfg.num_groups)):
            n_out = cfg.hidden_size * 2**g
            blocks = [
                ResBlock(n_in if b == 0 else n_out, n_out, post_gain, (1, 3, 3, 3))
                for b in range(cfg.blocks_per_group)
            ]
            if g > 0:
                blocks.append(nn.Upsample(scale_factor=2, mode="nearest"))
            groups.append(nn.Sequential(*blocks))
            n_in = n_out
        self.groups = nn.Sequential(*groups)
        self.output = nn.Sequential(nn.ReLU(), nn.Conv2d(n_in, 2 * cfg.channels, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.output(self.groups(self.input(z)))


def gumbel_softmax(
    logits: torch.Tensor,
    temperature: float,
    dim: int = 1,
    noise: torch.Tensor | None = None,
    noise_scale: float = 1.0,
) -> torch.Tensor:
    """softmax((logits + s g) / tau) with g ~ Gumbel(0, 1) i.i.d. (pass `noise` to fix g); s = 0 is the
    plain softmax at temperature tau."""
    if noise_scale == 0.0:
        return F.softmax(logits / temperature, dim=dim)
    if noise is None:
        uniform = torch.rand_like(logits).clamp_(1e-9, 1 - 1e-9)
        noise = -torch.log(-torch.log(uniform))
    return F.softmax((logits + noise_scale * noise) / temperature, dim=dim)


def logit_laplace_nll(x: torch.Tensor, stats: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-element negative log-likelihood of [0, 1] pixels `x` under the logit-Laplace distribution
    whose location and log scale are `stats`'s two channel halves:
    -log p(y) = log(2b) + log y + log(1 - y) + |logit(y) - mu| / b, y = map_pixels(x)."""
    mu, log_b = stats.chunk(2, dim=1)
    y = map_pixels(x, eps)
    return (
        math.log(2) + log_b + torch.log(y) + torch.log1p(-y) + (torch.logit(y) - mu).abs() * torch.exp(-log_b)
    )


@dataclass
class DVAEOutput:
    loss: torch.Tensor  # (nll + beta * kl) per image, divided by its number of pixel values, batch mean
    reconstruction_nll: torch.Tensor  # per pixel value (the squared error for "mse")
    kl: torch.Tensor  # per token, against the uniform prior
    reconstruction: torch.Tensor  # (B, C, H, W) in [0, 1]
    logits: torch.Tensor  # (B, K, h, w)


class DiscreteVAE(nn.Module, PretrainedMixin):
    """Image tokenizer: `encode` pixels to tokens, `decode` tokens to pixels, `forward` trains."""

    config_class = DVAEConfig
    base_model_prefix = ""

    def __init__(self, config: DVAEConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    def forward(self, images: torch.Tensor, temperature: float, kl_weight: float) -> DVAEOutput:
        """`images` (B, C, H, W) in [0, 1]; the relaxation's temperature and the KL weight of this step."""
        cfg = self.config
        # The encoder sees pixels in the same (eps, 1 - eps) range the likelihood is defined on.
        logits = self.encoder(map_pixels(images, cfg.logit_laplace_eps))
        z = gumbel_softmax(logits, temperature, dim=1, noise_scale=cfg.gumbel_noise)
        stats = self.decoder(z)
        reconstruction = self.pixels(stats)
        if cfg.reconstruction_loss == "mse":
            nll = (reconstruction - images) ** 2
        else:
            nll = logit_laplace_nll(images, stats, cfg.logit_laplace_eps)
        log_q = F.log_softmax(logits, dim=1)
        # KL(q || uniform) = sum_k q log q + log K, per token.
        kl = (log_q.exp() * log_q).sum(dim=1) + math.log(cfg.codebook_size)
        per_image = nll.flatten(1).sum(1) + kl_weight * kl.flatten(1).sum(1)
        return DVAEOutput(
            loss=(per_image / nll[0].numel()).mean(),
            reconstruction_nll=nll.mean(),
            kl=kl.mean(),
            reconstruction=reconstruction,
            logits=logits,
        )

    def schedule(self, step: int) -> tuple[float, float]:
        """(temperature, KL weight) at optimiser step `step`: the paper's cosine annealing."""
        cfg = self.config
        temperature = cosine_anneal(
            step, cfg.temperature_start, cfg.temperature_end, cfg.temperature_anneal_steps
        )
        kl_weight = cosine_anneal(step, 0.0, cfg.kl_weight, cfg.kl_anneal_steps)
        return temperature, kl_weight

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) in [0, 1] -> token grid (B, H / d, W / d) of int64."""
        return self.encoder(map_pixels(images, self.config.logit_laplace_eps)).argmax(dim=1)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token grid (B, h, w) -> images (B, C, h * d, w * d) in [0, 1]."""
        one_hot = F.one_hot(tokens, self.config.codebook_size).permute(0, 3, 1, 2).float()
        return self.pixels(self.decoder(one_hot))

    def pixels(self, stats: torch.Tensor) -> torch.Tensor:
        """The decoder's locations as [0, 1] pixels (openai/DALL-E: unmap(sigmoid(mu)))."""
        mu = stats[:, : self.config.channels]
        return unmap_pixels(torch.sigmoid(mu), self.config.logit_laplace_eps)
