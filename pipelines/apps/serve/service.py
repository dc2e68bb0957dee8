"""The work behind the endpoints: detector and model workers, the bound on requests in flight, timeouts."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import torch
from PIL import Image

from extraction.preprocess import resize_image
from pipelines.apps.caption import CaptionResult
from pipelines.apps.generate.rerank_captioner import caption_log_likelihood
from pipelines.apps.generate.sample import SampleSettings
from pipelines.apps.serve.backend import Answered, Backend
from pipelines.apps.serve.batching import Batcher
from pipelines.apps.serve.config import ServeConfig
from storage import RegionFeatures


class ServiceError(Exception):
    """A request the server refuses or cannot complete: an HTTP status and a message for the JSON body."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


class Service:
    """The detector and model workers and the bound on requests in flight."""

    def __init__(self, backend: Backend, config: ServeConfig):
        self.backend = backend
        self.config = config
        self.pending = 0
        self.detector = Batcher(self._detect, config.max_batch, config.max_wait_ms / 1000, "xmodal-detector")
        # questions and captions take turns on one thread: two models computing at once would only
        # share the same cores
        self.model = Batcher(self._call, 1, 0.0, "xmodal-model")

    def _detect(self, items: list[tuple[np.ndarray, str, tuple[int, int]]]) -> list[RegionFeatures]:
        images, names, sizes = zip(*items, strict=True)
        return self.backend.detect(list(images), list(names), list(sizes))

    @staticmethod
    def _call(items: list) -> list:
        return [fn(*args) for fn, *args in items]

    @contextlib.contextmanager
    def admitted(self):
        """Count the request in flight, or refuse it when `max_pending` already are."""
        if self.pending >= self.config.max_pending:
            raise ServiceError(
                503,
                f"server busy: {self.pending} requests are already waiting for the models "
                f"(--max-pending {self.config.max_pending}); retry shortly",
                {"Retry-After": "1"},
            )
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1

    async def run(self, work):
        """Await `work` within the timeout; queued model calls of a timed-out request are dropped."""
        try:
            return await asyncio.wait_for(work, self.config.timeout_s)
        except asyncio.TimeoutError:
            raise ServiceError(
                504,
                f"timed out after {self.config.timeout_s:g} s waiting for the models "
                f"({self.pending} requests in flight); retry later or raise --timeout",
            ) from None
        except ValueError as exc:  # the ask and caption apps' refusals: no region found, feature width
            raise ServiceError(422, str(exc)) from None

    async def regions(self, image: np.ndarray, name: str, size: tuple[int, int]) -> RegionFeatures:
        """The regions of `image` (at the working size) in the pixels of its original, (h, w) `size`."""
        return await asyncio.wrap_future(self.detector.submit((image, name, size)))

    async def ask(
        self, image: np.ndarray, name: str, size: tuple[int, int], question: str, top_k: int
    ) -> tuple[RegionFeatures, Answered]:
        regions = await self.regions(image, name, size)
        answered = await asyncio.wrap_future(
            self.model.submit((self.backend.answer, regions, question, top_k))
        )
        return regions, answered

    async def caption(
        self, image: np.ndarray, name: str, size: tuple[int, int], beam_size: int
    ) -> tuple[RegionFeatures, CaptionResult]:
        regions = await self.regions(image, name, size)
        work = (self.backend.caption, regions, beam_size)
        captioned = await asyncio.wrap_future(self.model.submit(work))
        return regions, captioned

    async def generate(
        self, prompt: str, settings: SampleSettings, rerank: str
    ) -> tuple[list[Image.Image], torch.Tensor]:
        """The candidates for `prompt` and their scores: the transformer's (`likelihood`, `none`) or the
        held captioner's log-likelihood of the prompt on each candidate's regions (`captioner`), the
        regions found by the server's detector batcher like an upload's."""
        generator = self.backend.generator
        tokens, images = await asyncio.wrap_future(self.model.submit((generator.sample, prompt, settings)))
        if rerank != "captioner":
            work = (generator.scores, prompt, tokens, rerank)
            return images, await asyncio.wrap_future(self.model.submit(work))
        min_size, max_size = self.backend.working_size
        found = await asyncio.gather(
            *(
                self.regions(
                    resize_image(np.ascontiguousarray(np.asarray(im)[:, :, ::-1]), min_size, max_size),
                    f"sample_{i}",
                    (im.height, im.width),
                )
                for i, im in enumerate(images)
            )
        )
        work = (caption_log_likelihood, self.backend.captioner.tuned, prompt, list(found))
        return images, await asyncio.wrap_future(self.model.submit(work))

    def close(self) -> None:
        self.detector.close()
        self.model.close()
