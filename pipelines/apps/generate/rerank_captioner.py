"""Re-ranking DALL-E's candidates by a fine-tuned captioner (Show-Attend-Tell, Up-Down): the log-likelihood
it gives the prompt when reading each candidate's detector regions, in place of CLIP's similarity."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from PIL import Image

from extraction.detector import Detector
from pipelines.apps.ask import build_detector
from pipelines.apps.generate.rerank import detect_images
from pipelines.data.captions import tokenize_caption
from pipelines.data.regions import pad_regions, region_arrays
from pipelines.tasks.caption import CaptionTask
from pipelines.tasks.finetuned import Finetuned, load_finetuned
from storage.records import RegionFeatures

log = logging.getLogger(__name__)


@torch.no_grad()
def caption_log_likelihood(tuned: Finetuned, prompt: str, regions: Sequence[RegionFeatures]) -> torch.Tensor:
    """(n,) log p(`<bos>` prompt `<eos>` | regions) under the captioner, teacher-forced, one row per
    region record; records without a region score -inf (the captioner has nothing to read)."""
    vocab = tuned.tokenizer
    ids = vocab.encode(tokenize_caption(prompt), tuned.max_length)
    scores = torch.full((len(regions),), float("-inf"))
    rows = [i for i, r in enumerate(regions) if r.num_boxes > 0]
    if len(rows) < len(regions):
        log.warning(
            "%d of %d candidates have no detected region: ranked last", len(regions) - len(rows), len(regions)
        )
    if not rows:
        return scores
    arrays = [region_arrays(regions[i]) for i in rows]
    inputs = pad_regions([f for f, _ in arrays], [b for _, b in arrays]).model_inputs()
    device = next(tuned.model.parameters()).device
    tokens = torch.tensor(ids, device=device)[None].expand(len(rows), -1)
    out = tuned.model(
        input_ids=tokens[:, :-1],
        visual_feats=inputs["visual_feats"].float().to(device),
        visual_attention_mask=inputs["visual_attention_mask"].to(device),
    )
    logp = F.log_softmax(out.logits.float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1).sum(-1)
    scores[torch.tensor(rows)] = logp.cpu()
    return scores


def load_region_model(
    checkpoint: str | Path, detector: str | Path | None, kind: type, flag: str, what: str
) -> tuple[Finetuned, Detector]:
    """A fine-tuned `kind` checkpoint and the detector that makes the regions it reads (`detector`, else
    the one its features record); one-line errors naming `flag`."""
    try:
        tuned = load_finetuned(checkpoint)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{flag}: {exc}") from exc
    if not issubclass(tuned.kind, kind):
        raise ValueError(
            f"{flag} {checkpoint}: a {tuned.task} checkpoint; give a {what} run's best/ "
            f"(`xmodal finetune --task {kind.name}`)"
        )
    if detector is not None and not Path(detector).is_dir():
        raise FileNotFoundError(f"{flag}-detector {str(detector)!r} is not a detector directory")
    built = build_detector(tuned, None if detector is None else str(detector), device="cpu")
    dim = tuned.model.config.visual_feat_dim
    if built.feature_dim != dim:
        raise ValueError(
            f"the detector gives {built.feature_dim}-d features but {flag} {checkpoint} reads {dim}-d: "
            f"pass the detector its features were extracted with ({flag}-detector)"
        )
    return tuned, built


@dataclass
class RegionReranker:
    """A fine-tuned model that scores (prompt, candidate) on the candidates' detector regions, and the
    detector that makes them; each kind sets which runs it loads and how it scores."""

    tuned: Finetuned
    detector: Detector
    source: str = ""

    task_class: ClassVar[type]  # the fine-tuning task whose checkpoints it loads
    flag: ClassVar[str]  # the option naming the run, in its errors
    what: ClassVar[str]  # the run's kind, in its errors
    label: ClassVar[str]  # the re-ranker's name in the report

    @classmethod
    def load(cls, checkpoint: str | Path, detector: str | Path | None = None) -> RegionReranker:
        """`checkpoint`: a fine-tuned run's directory (best/ or last/); `detector`: the detector directory
        its features came from (default: the one its features record)."""
        tuned, built = load_region_model(checkpoint, detector, cls.task_class, cls.flag, cls.what)
        return cls(
            tuned, built, f"{cls.label} {tuned.settings.get('arch', '?')} {Path(checkpoint).resolve()}"
        )

    def regions(self, images: Sequence[Image.Image]) -> list[RegionFeatures]:
        return detect_images(self.detector, images, prefix="candidate_")

    def score(self, prompt: str, regions: Sequence[RegionFeatures]) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, prompt: str, images: Sequence[Image.Image]) -> torch.Tensor:
        """(n,) the score of `prompt` with each image: higher = better match."""
        return self.score(prompt, self.regions(images))


class CaptionerReranker(RegionReranker):
    """A captioning checkpoint: the log-likelihood it gives the prompt on each candidate."""

    task_class, flag, what, label = CaptionTask, "--captioner", "captioning", "captioner"

    def score(self, prompt: str, regions: Sequence[RegionFeatures]) -> torch.Tensor:
        return caption_log_likelihood(self.tuned, prompt, regions)
