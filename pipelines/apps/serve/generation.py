"""The server's text-to-image model (a `xmodal generate train` run): samples for a prompt, their re-ranking
scores by the transformer itself, and the images as PNG data URLs for the page."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from pipelines.apps.generate.rerank import rerank_scores
from pipelines.apps.generate.sample import SampleSettings, decode, sample_tokens
from pipelines.tasks.text_to_image import TextToImageModel

SERVER_RERANKERS = ("likelihood", "captioner", "none")  # contrastive needs other prompts: not offered


@dataclass
class HeldGenerator:
    """A DALL-E checkpoint the server holds and the directory it was loaded from."""

    model: TextToImageModel
    checkpoint: str

    @classmethod
    def load(cls, checkpoint: str | Path) -> HeldGenerator:
        return cls(TextToImageModel.load(checkpoint), str(checkpoint))

    def describe(self) -> dict:
        cfg = self.model.dvae.config
        return {"checkpoint": self.checkpoint, "image_size": cfg.image_size, "grid": cfg.grid_size}

    def sample(self, prompt: str, settings: SampleSettings) -> tuple[torch.Tensor, list[Image.Image]]:
        """The candidates' image tokens and their decoded images."""
        tokens = sample_tokens(self.model, prompt, settings)
        return tokens, decode(self.model, tokens)

    def scores(self, prompt: str, tokens: torch.Tensor, method: str) -> torch.Tensor:
        """The transformer's own re-ranking scores (`likelihood`, or zeros for `none`)."""
        return rerank_scores(self.model, prompt, tokens, method)


def png_data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")
