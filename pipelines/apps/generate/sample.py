"""Text to image with a trained DALL-E checkpoint: sample token grids after a prompt (top-k / top-p, seeded)
and decode them with the checkpoint's dVAE; also images decoded from uniformly random tokens (a baseline)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from PIL import Image

from model.ranges import check_fields
from pipelines.data.captions import tokenize_caption
from pipelines.tasks.text_to_image import TextToImageModel, encode_prompt


@dataclass
class SampleSettings:
    RANGES: ClassVar[dict[str, str]] = {
        "n": "[1, 4096]",
        "top_k": "[1, 65536]",
        "top_p": "(0, 1]",
        "temperature": "(0, 1000]",
        "seed": "[0, 4294967295]",
        "guidance": "[0, 100]",
    }

    n: int = 8
    top_k: int | None = None
    top_p: float | None = 0.9
    temperature: float = 1.0
    seed: int = 0
    # classifier-free guidance scale: 1 samples the model as trained; above 1 needs a model trained with
    # task.caption_dropout > 0 (it then follows the prompt more closely)
    guidance: float = 1.0

    def __post_init__(self) -> None:
        check_fields(self, "command line")  # before a checkpoint is read


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """(B, 3, H, W) in [0, 1] -> RGB images."""
    arrays = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(np.ascontiguousarray(a)) for a in arrays]


def prompt_text(model: TextToImageModel, prompt: str) -> torch.Tensor:
    """(1, text_length) ids of `prompt` with the model's per-position padding tokens."""
    transformer = model.transformer
    text, padding = encode_prompt(model.vocab, prompt, transformer.config.text_length)
    return transformer.pad_text(torch.from_numpy(text)[None], torch.from_numpy(padding)[None])


def prompt_cut(model: TextToImageModel, prompt: str) -> str | None:
    """A note when the transformer reads only the start of `prompt` (the words between <bos> and <eos>)."""
    read = model.transformer.config.text_length - 2
    words = len(tokenize_caption(prompt))
    return f"the model reads the prompt's first {read} of its {words} words" if words > read else None


def prompt_unknown(model: TextToImageModel, prompt: str) -> str | None:
    """A note naming the words of `prompt` the model's vocabulary lacks (each is read as `<unk>`), or None;
    a ValueError naming the prompt when it has no known word at all (the model would draw from nothing)."""
    words = tokenize_caption(prompt)
    unknown = list(dict.fromkeys(w for w in words if w not in model.vocab.index))
    if words and len(unknown) < len(set(words)):
        return f"the model does not know {', '.join(map(repr, unknown))}: read as <unk>" if unknown else None
    examples = ", ".join(w for w in model.vocab.words[4:9])
    raise ValueError(
        f"no word of the prompt {prompt!r} is in the model's vocabulary of {len(model.vocab)} words "
        f"(e.g. {examples}): describe the picture with words it was trained on"
    )


@torch.no_grad()
def sample_tokens(model: TextToImageModel, prompt: str, settings: SampleSettings) -> torch.Tensor:
    """(n, grid^2) image tokens drawn after `prompt`; the same seed gives the same tokens."""
    generator = torch.Generator().manual_seed(settings.seed)
    return model.transformer.generate(
        prompt_text(model, prompt).expand(settings.n, -1),
        top_k=settings.top_k,
        top_p=settings.top_p,
        temperature=settings.temperature,
        generator=generator,
        guidance=settings.guidance,
        unconditional=prompt_text(model, "") if settings.guidance != 1.0 else None,
    )


@torch.no_grad()
def decode(model: TextToImageModel, tokens: torch.Tensor) -> list[Image.Image]:
    """Images of (n, grid^2) token rows, decoded by the checkpoint's dVAE."""
    grid = model.transformer.config.image_grid
    return to_pil(model.dvae.decode(tokens.view(tokens.shape[0], grid, grid)))


def sample(model: TextToImageModel, prompt: str, settings: SampleSettings) -> list[Image.Image]:
    """`settings.n` images for `prompt`; the same seed gives the same images."""
    return decode(model, sample_tokens(model, prompt, settings))


@torch.no_grad()
def random_token_images(model: TextToImageModel, n: int, seed: int) -> list[Image.Image]:
    """Images decoded from uniformly random token grids: what a model that ignores the prompt gets."""
    cfg = model.dvae.config
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.codebook_size, (n, cfg.grid_size, cfg.grid_size), generator=generator)
    return to_pil(model.dvae.decode(tokens))


def write_images(images: list[Image.Image], out: str | Path, stem: str = "sample") -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}_{i:03d}.png" for i in range(len(images))]
    for image, path in zip(images, paths, strict=True):
        image.save(path)
    return paths
