"""Re-ranking DALL-E's candidates without CLIP: by the transformer's own log-likelihood of each candidate's
image tokens given the prompt, optionally contrasted with other prompts (how much better this prompt
explains the image than prompts about something else), or by a judge that looks at the decoded images
(a fine-tuned captioner's likelihood of the prompt: `rerank_captioner`; a retrieval-tuned
LXMERT/ViLBERT's matching score: `rerank_matching`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from extraction.detector import Detector
from pipelines.apps.generate.sample import decode, prompt_text
from pipelines.tasks.text_to_image import TextToImageModel
from storage.records import RegionFeatures

RERANKERS = ("likelihood", "contrastive", "captioner", "matching", "none")

Judge = Callable[[str, Sequence[Image.Image]], torch.Tensor]  # (prompt, images) -> (n,) higher = better


def detect_images(
    detector: Detector, images: Sequence[Image.Image], prefix: str = ""
) -> list[RegionFeatures]:
    """Decoded candidates through the detector, which reads BGR arrays (as OpenCV loads images); record
    ids are `prefix` + the image's index."""
    arrays = [np.ascontiguousarray(np.asarray(im.convert("RGB"))[:, :, ::-1]) for im in images]
    return detector.detect(arrays, ids=[f"{prefix}{i}" for i in range(len(arrays))])


@torch.no_grad()
def image_log_likelihood(model: TextToImageModel, prompt: str, tokens: torch.Tensor) -> torch.Tensor:
    """(n,) sum over the grid of log p(token | prompt, earlier tokens) for (n, grid^2) token rows."""
    text = prompt_text(model, prompt).expand(tokens.shape[0], -1)
    logits = model.transformer(text, tokens).image_logits
    return F.log_softmax(logits.float(), dim=-1).gather(-1, tokens[..., None]).squeeze(-1).sum(-1)


def rerank_scores(
    model: TextToImageModel,
    prompt: str,
    tokens: torch.Tensor,
    method: str = "likelihood",
    contrast: Sequence[str] = (),
    judge: Judge | None = None,
) -> torch.Tensor:
    """(n,) scores, higher = better match. `likelihood`: log p(tokens | prompt). `contrastive`: that minus
    the mean log p(tokens | c) over the `contrast` prompts (pointwise mutual information against them).
    `captioner` / `matching`: `judge` (a `CaptionerReranker` / `MatchingReranker`) on the decoded
    candidates. `none`: zeros (the sampling
    order is kept)."""
    if method not in RERANKERS:
        raise ValueError(f"--rerank {method!r}: choose one of {', '.join(RERANKERS)}")
    if method == "none":
        return torch.zeros(tokens.shape[0])
    if method in ("captioner", "matching"):
        if judge is None:
            flag = "--captioner RUN (a captioning run's best/)" if method == "captioner" else "--matcher RUN"
            raise ValueError(f"--rerank {method} needs {flag}")
        return judge(prompt, decode(model, tokens)).float()
    score = image_log_likelihood(model, prompt, tokens)
    if method == "contrastive":
        if not contrast:
            raise ValueError("--rerank contrastive needs other prompts to contrast with")
        others = torch.stack([image_log_likelihood(model, c, tokens) for c in contrast])
        score = score - others.mean(0)
    return score


def rank(scores: torch.Tensor) -> list[int]:
    """Candidate indices best first; ties keep the sampling order."""
    return torch.argsort(scores, descending=True, stable=True).tolist()
