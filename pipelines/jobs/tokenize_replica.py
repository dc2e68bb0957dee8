"""The tokenize job's replica and sink for the extraction job's pool (pipelines.jobs.extract.pool): a dVAE
in place of the detector, token grids in place of region records, an image-token store in place of the
feature store."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pipelines.jobs.extract.actors import DecodedBatch, reason

TokenRecord = tuple[str, np.ndarray]  # (img_id, (grid, grid) int tokens)


def tokenizer_input(bgr: np.ndarray, size: int):
    """A decoded BGR uint8 image as the dVAE's (3, size, size) float input in [0, 1]: RGB, bicubic resize,
    as `pipelines.tasks.generation.ImageFolder` feeds the dVAE in training."""
    import torch
    from PIL import Image

    rgb = Image.fromarray(np.ascontiguousarray(bgr[:, :, ::-1]))
    rgb = rgb.resize((size, size), Image.Resampling.BICUBIC)
    return torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)


class TokenReplica:
    """One dVAE; the pool calls its `detect` with a decoded batch and gets the token grids and the images
    that failed (reported, never raised)."""

    def __init__(self, build: dict, threads: int) -> None:
        import torch

        from pipelines.tasks.generation import load_tokenizer

        torch.set_num_threads(threads)
        self.device = torch.device(build.get("device", "cpu"))
        self.dvae = load_tokenizer(build["tokenizer"]).eval().to(self.device)

    def info(self) -> dict:
        cfg = self.dvae.config
        return {"grid": cfg.grid_size, "codebook_size": cfg.codebook_size, "image_size": cfg.image_size}

    def detect(self, batch: DecodedBatch) -> tuple[list[TokenRecord], list[tuple[str, str]]]:
        import torch

        failures = list(batch.failures)
        size = self.dvae.config.image_size
        ids, inputs = [], []
        for img_id, image in zip(batch.ids, batch.images, strict=True):
            try:
                inputs.append(tokenizer_input(image, size))
                ids.append(img_id)
            except Exception as exc:  # one image's problem, recorded, never the batch's
                failures.append((img_id, f"could not be resized for the tokenizer: {reason(exc)}"))
        if not inputs:
            return [], failures
        with torch.no_grad():
            grids = self.dvae.encode(torch.stack(inputs).to(self.device)).cpu().numpy()
        return list(zip(ids, grids, strict=True)), failures


class TokenSink:
    """The image-token store, written by the driver as the replicas' grids arrive."""

    def __init__(self, writer) -> None:
        self.writer = writer

    def take(self, records: list[TokenRecord]) -> int:
        """Write a replica's grids; how many were new."""
        return sum(1 for img_id, grid in records if self.writer.put(img_id, grid))

    def flush(self) -> None:
        self.writer.commit()

    def committed(self, slot: int, ids: Iterable[str]) -> set[str]:
        """Nothing of a dead replica's batches reached the store: only the driver writes it."""
        return set()
