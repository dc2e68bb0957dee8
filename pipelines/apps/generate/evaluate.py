"""`xmodal generate evaluate`: DALL-Eval-style prompt accuracy of a DALL-E checkpoint, judged by a trained
detector, against images decoded from random tokens and against the images made for another prompt."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import numpy as np
from PIL import Image

from extraction.detector import Detector
from model.ranges import check_fields
from pipelines.apps.generate.rerank import RERANKERS, Judge, detect_images, rerank_scores
from pipelines.apps.generate.sample import SampleSettings, decode, random_token_images, sample_tokens
from pipelines.scoring.fid import FidError, InceptionFeatures, fid, skip_reason
from pipelines.scoring.prompt_accuracy import Detection, prompt_targets, satisfies
from pipelines.tasks.text_to_image import TextToImageModel
from storage.records import RegionFeatures

log = logging.getLogger(__name__)

CONTRAST_PROMPTS = 4  # other prompts the contrastive re-ranker compares each candidate against


@dataclass
class EvalSettings:
    RANGES: ClassVar[dict[str, str]] = {"threshold": "[0, 1]", "max_detections": "[1, 100000]"}

    sampling: SampleSettings
    rerank: str = "likelihood"
    threshold: float = 0.5  # detections at or above this class score count
    max_detections: int = 10

    def __post_init__(self) -> None:
        check_fields(self, "command line", names=("threshold", "max_detections"))


@dataclass
class FidInputs:
    """What FID needs: the Inception features and the real images to compare the samples with."""

    extractor: InceptionFeatures
    real: list[Image.Image]


def read_images(folder: str | Path, size: int) -> list[Image.Image]:
    """The real images of `folder` (by suffix), resized to the generated images' square `size`."""
    from pipelines.jobs.image_inputs import iter_images

    folder = Path(folder)
    if not folder.is_dir():
        raise FidError(f"--fid-images {str(folder)!r} is not a folder of real images")
    images = []
    for item in iter_images([folder]):
        try:
            with Image.open(item.path) as im:
                images.append(im.convert("RGB").resize((size, size), Image.Resampling.BICUBIC))
        except OSError as exc:
            raise FidError(
                f"image {item.path!r} cannot be read ({exc}); remove it from --fid-images"
            ) from exc
    return images


def load_fid(weights: str | None, images: str | None, size: int) -> FidInputs | None:
    """FID's inputs when both are given and torch-fidelity is installed; None (FID skipped) otherwise."""
    if bool(weights) != bool(images):
        raise FidError("--fid-weights and --fid-images go together (the Inception weights, the real images)")
    if skip_reason(weights, images) is not None:
        return None
    return FidInputs(InceptionFeatures(weights), read_images(images, size))


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per non-empty line of a text file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {str(path)!r} is not a file (one prompt per line)")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path}: no prompts (write one per line)")
    return prompts


def load_detector(directory: str | Path, settings: EvalSettings) -> Detector:
    """A trained detector directory with its class and attribute names, keeping every region whose best
    class reaches the threshold (detectron2's rule: per-class NMS, no minimum count)."""
    if not Path(directory).is_dir():
        raise FileNotFoundError(
            f"--detector {str(directory)!r} is not a detector directory "
            "(a `xmodal detector train` run's best/)"
        )
    detector = Detector.build(
        weights=directory,
        selection="threshold",
        min_boxes=0,
        max_boxes=settings.max_detections,
        score_thresh=settings.threshold,
    )
    if not detector.classes or not detector.attributes:
        raise ValueError(
            f"{directory}: the detector carries no class or attribute names; train it with `xmodal detector "
            "train` on annotations whose categories are shapes and attributes colours"
        )
    return detector


def detections(record: RegionFeatures, classes: Sequence[str], attributes: Sequence[str]) -> list[Detection]:
    """A region record as (shape, colour, score): its class name, its likeliest attribute, the class score."""
    return [
        Detection(classes[int(o)], attributes[int(a)], float(s))
        for o, a, s in zip(record.objects_id, record.attrs_id, record.objects_conf, strict=True)
    ]


def detect(detector: Detector, images: list[Image.Image]) -> list[list[Detection]]:
    return [detections(r, detector.classes, detector.attributes) for r in detect_images(detector, images)]


def evaluate(
    model: TextToImageModel,
    detector: Detector,
    prompts: Sequence[str],
    settings: EvalSettings,
    judge: Judge | None = None,
    reranker: str | None = None,
    fid_inputs: FidInputs | None = None,
) -> dict:
    """Prompt accuracy of the best-ranked of n samples per prompt (`prompt_accuracy`), of every sample
    (`sample_accuracy`), of the prompts where at least one of the n passes (`best_of_n_accuracy`: what a
    perfect re-ranker would reach), of n images decoded from random tokens per prompt
    (`random_token_accuracy`), and of each prompt's best sample judged against the next prompt's targets
    (`other_prompt_accuracy`, pairs that ask for the same objects left out). Prompts naming no colour and
    shape the detector knows are left out and counted. `judge` scores the decoded candidates for
    `--rerank captioner`; `reranker` describes it in the result (default: the method's name). With
    `fid_inputs`, `fid` is the FID of the best-ranked samples against the real images; without,
    `fid_skipped` says what to provide."""
    if settings.rerank not in RERANKERS:
        raise ValueError(f"--rerank {settings.rerank!r}: choose one of {', '.join(RERANKERS)}")
    shapes, colours = detector.classes, detector.attributes
    scored = [(p, prompt_targets(p, shapes, colours)) for p in prompts]
    kept = [(p, t) for p, t in scored if t]
    if not kept:
        raise ValueError(f"none of the {len(prompts)} prompts names a colour {colours} and shape {shapes}")
    if len(kept) < len(scored):
        log.warning(
            "%d of %d prompts name no checkable colour and shape: left out",
            len(scored) - len(kept),
            len(scored),
        )
    n, threshold = settings.sampling.n, settings.threshold
    best_hits, sample_hits, any_hits, random_hits, best_found, best_images = [], [], [], [], [], []
    for i, (prompt, wanted) in enumerate(kept):
        sampling = replace(settings.sampling, seed=settings.sampling.seed + i)
        tokens = sample_tokens(model, prompt, sampling)
        contrast = [kept[(i + k) % len(kept)][0] for k in range(1, CONTRAST_PROMPTS + 1) if len(kept) > k]
        scores = rerank_scores(model, prompt, tokens, settings.rerank, contrast, judge)
        images = decode(model, tokens)
        found = detect(detector, images)
        hits = [satisfies(d, wanted, threshold) for d in found]
        best = int(scores.argmax()) if settings.rerank != "none" else 0
        best_images.append(images[best])
        best_hits.append(hits[best])
        best_found.append(found[best])
        sample_hits.extend(hits)
        any_hits.append(any(hits))
        randoms = detect(detector, random_token_images(model, n, seed=settings.sampling.seed + 100_000 + i))
        random_hits.extend(satisfies(d, wanted, threshold) for d in randoms)
    other_hits = [
        satisfies(best_found[i], kept[(i + 1) % len(kept)][1], threshold)
        for i in range(len(kept))
        if kept[(i + 1) % len(kept)][1] != kept[i][1]
    ]
    return {
        "prompt_accuracy": _mean(best_hits),
        "sample_accuracy": _mean(sample_hits),
        "best_of_n_accuracy": _mean(any_hits),
        "random_token_accuracy": _mean(random_hits),
        "other_prompt_accuracy": _mean(other_hits),
        "prompts": len(kept),
        "prompts_left_out": len(scored) - len(kept),
        "samples_per_prompt": n,
        "rerank": settings.rerank,
        "reranker": reranker or settings.rerank,
        "threshold": threshold,
        "fid": None if fid_inputs is None else fid(best_images, fid_inputs.real, fid_inputs.extractor),
        "fid_skipped": skip_reason(None, None) if fid_inputs is None else None,
    }


def _mean(hits: Sequence[bool]) -> float | None:
    return float(np.mean(hits)) if hits else None
