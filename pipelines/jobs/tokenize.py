"""Extract DALL-E token grids of an image folder into an image-token store once, resuming a partial store
(ids already stored are skipped); unreadable images are logged to errors.jsonl and skipped."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from model.dalle import DiscreteVAE
from pipelines.jobs.image_inputs import iter_images
from pipelines.tasks.generation import ImageFolder, load_tokenizer
from storage.token_store import TokenWriter

log = logging.getLogger(__name__)


@dataclass
class TokenizeSummary:
    written: int
    skipped_present: int
    failed: int
    total: int


def tokenize_images(
    images: str | Path, tokenizer: str | Path, out: str | Path, batch_size: int = 64
) -> TokenizeSummary:
    """Encode every image of `images` with the dVAE of `tokenizer` (a run or a dVAE directory) into `out`."""
    dvae: DiscreteVAE = load_tokenizer(tokenizer).eval()
    cfg = dvae.config
    inputs = list(iter_images([images]))
    provenance = {"tokenizer": str(Path(tokenizer).resolve()), "images": str(Path(images).resolve())}
    out = Path(out)
    written = present = failed = 0
    with TokenWriter(out, cfg.grid_size, cfg.codebook_size, provenance) as writer:
        todo = [item for item in inputs if item.img_id not in writer]
        present = len(inputs) - len(todo)
        loader = ImageFolder([item.path for item in todo], cfg.image_size)
        for start in range(0, len(todo), batch_size):
            batch, ids = [], []
            for k, item in enumerate(todo[start : start + batch_size], start):
                try:
                    batch.append(loader[k])
                    ids.append(item.img_id)
                except ValueError as err:
                    failed += 1
                    log.warning("%s", err)
                    with open(out / "errors.jsonl", "a") as f:
                        f.write(json.dumps({"img_id": item.img_id, "error": str(err)}) + "\n")
            if not batch:
                continue
            with torch.no_grad():
                grids = dvae.encode(torch.stack(batch)).numpy()
            for img_id, grid in zip(ids, grids, strict=True):
                written += writer.put(img_id, grid)
            writer.commit()
    return TokenizeSummary(written=written, skipped_present=present, failed=failed, total=len(inputs))
