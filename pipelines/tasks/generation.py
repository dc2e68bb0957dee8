"""DALL-E's image tokenizer as an engine task: a discrete VAE trained on an image folder, with the
paper's temperature and KL-weight annealing resumed exactly, validated by round-trip PSNR."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import nn
from torch.utils.data import Dataset

from model.dalle import DiscreteVAE, DVAEConfig
from pipelines.engine import config_io
from pipelines.engine.trainer import TrainConfig
from pipelines.jobs.image_inputs import iter_images

log = logging.getLogger(__name__)

PRIMARY_METRIC = "psnr"


@dataclass
class TokenizerTaskConfig:
    """What the tokenizer trains on: an image folder (or list file), a dVAE preset and field overrides."""

    RANGES: ClassVar[dict[str, str]] = {"valid_every": "[0, 1000000000]"}

    images: str = ""
    preset: str = "small"
    dvae: dict[str, Any] = field(default_factory=dict)
    valid_every: int = 20  # every k-th image (sorted order) is held out for the PSNR; 0 = none

    def __post_init__(self) -> None:
        # `task.dvae` overrides meet DVAEConfig's types and ranges when the run's config is resolved
        config_io.check_mapping_field((DVAEConfig,), self.dvae, "task.dvae")


def default_train_config(preset: str) -> TrainConfig:
    """The paper's optimiser is Adam at 1e-4 with batch 512; the small preset uses AdamW at 2e-3 on 32
    images per step for its 600 steps (the temperature's annealing length). At 16 images per step the
    codes it settled on depended on the seed: on the demo's scenes the judge confirmed 60 / 42 / 31 % of
    round trips for seeds 0 / 1 / 2, at 32 59 / 57 / 73 % (BENCHMARKS.md), for twice the time."""
    if preset == "small":
        return TrainConfig(
            lr=2e-3,
            batch_size=32,
            max_steps=600,
            warmup_ratio=0.02,
            weight_decay=0.0,
            trackers=[],
            eval_every=200,
            log_every=50,
            loader_workers=1,
        )
    return TrainConfig(lr=1e-4, batch_size=512, max_steps=3_000_000, weight_decay=0.0, warmup_ratio=0.0)


@dataclass
class TokenizerRun:
    """The whole run as written to config.yaml: `train.*` and `task.*` keys."""

    train: TrainConfig = field(default_factory=lambda: default_train_config("small"))
    task: TokenizerTaskConfig = field(default_factory=TokenizerTaskConfig)


class ImageFolder(Dataset):
    """Images as (C, S, S) floats in [0, 1], resized to the tokenizer's square input."""

    def __init__(self, paths: list[str], size: int) -> None:
        self.paths, self.size = paths, size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        path = self.paths[i]
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB").resize((self.size, self.size), Image.Resampling.BICUBIC)
        except (OSError, UnidentifiedImageError) as err:
            raise ValueError(f"image {path!r} cannot be read ({err}); remove or replace it") from err
        return torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)


class AnnealedDVAE(nn.Module):
    """The dVAE and the number of micro-batches it has trained on: a buffer, so checkpoints carry it and
    a resumed run continues the temperature and KL schedule where it stopped."""

    def __init__(self, dvae: DiscreteVAE, grad_accum: int) -> None:
        super().__init__()
        self.dvae = dvae
        self.grad_accum = grad_accum
        self.register_buffer("micro_steps", torch.zeros((), dtype=torch.long))

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        temperature, kl_weight = self.dvae.schedule(int(self.micro_steps) // self.grad_accum)
        if self.training:
            self.micro_steps += 1
        out = self.dvae(images, temperature, kl_weight)
        return {"loss": out.loss, "reconstruction": out.reconstruction_nll, "kl": out.kl}


def psnr(images: torch.Tensor, reconstructions: torch.Tensor) -> torch.Tensor:
    """Per-image peak signal-to-noise ratio in dB of [0, 1] images."""
    mse = ((images - reconstructions) ** 2).flatten(1).mean(1).clamp_min(1e-10)
    return 10 * torch.log10(1 / mse)


class TokenizerTask:
    """The Task the engine trains (see pipelines.engine.trainer.Task)."""

    primary_metric = PRIMARY_METRIC

    def __init__(self, cfg: TokenizerTaskConfig, grad_accum: int = 1) -> None:
        self.config = cfg
        self.dvae_config = DVAEConfig.preset(cfg.preset, **cfg.dvae)
        self.grad_accum = grad_accum
        paths = sorted(image.path for image in iter_images([cfg.images]))
        k = cfg.valid_every
        held = [p for i, p in enumerate(paths) if k and i % k == k - 1]
        self.train_paths = [p for i, p in enumerate(paths) if not (k and i % k == k - 1)]
        self.valid_paths = held
        if not self.train_paths:
            raise ValueError(f"{cfg.images}: no training images (found {len(paths)}); add images")
        log.info("tokenizer: %d training images, %d held out", len(self.train_paths), len(held))

    def build_model(self) -> nn.Module:
        return AnnealedDVAE(DiscreteVAE(self.dvae_config), self.grad_accum)

    def train_dataset(self) -> Dataset:
        return ImageFolder(self.train_paths, self.dvae_config.image_size)

    def valid_dataset(self) -> Dataset | None:
        return ImageFolder(self.valid_paths, self.dvae_config.image_size) if self.valid_paths else None

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        return {"images": torch.stack(items)}

    def loss(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = model(batch["images"])
        return out["loss"], {k: v.detach() for k, v in out.items() if k != "loss"}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader) -> dict[str, float]:
        dvae = _unwrap(model).dvae
        scores, codes = [], set()
        for b in loader:
            tokens = dvae.encode(b["images"])
            scores.append(psnr(b["images"], dvae.decode(tokens)))
            codes.update(tokens.unique().tolist())
        if not scores:
            return {}
        # Codebook usage: a collapsed dVAE (a handful of codes for the whole set) keeps the backgrounds and
        # loses the objects' colours and shapes, whatever its PSNR.
        return {PRIMARY_METRIC: float(torch.cat(scores).mean()), "codes_used": float(len(codes))}

    def save(self, model: nn.Module, directory: Path) -> None:
        _unwrap(model).dvae.save_pretrained(directory)


def _unwrap(model: nn.Module) -> AnnealedDVAE:
    return getattr(model, "module", model)


def load_tokenizer(path: str | Path) -> DiscreteVAE:
    """The dVAE of a tokenizer run (its best/, else last/) or of a dVAE directory."""
    path = Path(path)
    for candidate in (path / "best", path / "last", path):
        if (candidate / "config.json").is_file():
            return DiscreteVAE.from_pretrained(candidate)
    raise ValueError(f"{path}: no dVAE here (no best/, last/ or config.json); give a train-tokenizer run")
