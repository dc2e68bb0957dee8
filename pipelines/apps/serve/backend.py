"""The models the server holds, through the ask, caption and generate apps' functions: the detector, a
VQA/GQA model, a captioner and a text-to-image model (any may be absent, not all; the detector comes with
the first two)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipelines.apps.ask import ask, build_detector, detector_settings
from pipelines.apps.caption import CaptionResult, caption_regions
from pipelines.apps.serve.generation import HeldGenerator
from pipelines.engine.devices import DEFAULT_DEVICE, pick_device
from pipelines.tasks.caption import CaptionTask
from pipelines.tasks.finetuned import Finetuned, load_finetuned
from storage import RegionFeatures

if TYPE_CHECKING:
    from extraction import Detector

log = logging.getLogger(__name__)


@dataclass
class Held:
    """A fine-tuned model the server holds and the directory it was loaded from."""

    tuned: Finetuned
    checkpoint: str

    def describe(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "task": self.tuned.task,
            "arch": self.tuned.settings.get("arch"),
        }


@dataclass
class Answered:
    """Top answers with their scores and the answer's attention over the regions (sums to 1)."""

    answers: list[tuple[str, float]]
    attention: np.ndarray


class Backend:
    """One detector, and a question-answering model (`answerer`), a captioner, or both; `detect` takes a
    batch of images, `answer` and `caption` one image each."""

    def __init__(
        self,
        detector: Detector | None,
        answerer: Held | None = None,
        captioner: Held | None = None,
        object_names: list[str] | None = None,
        attr_names: list[str] | None = None,
        generator: HeldGenerator | None = None,
    ):
        if answerer is None and captioner is None and generator is None:
            raise ValueError("the server needs a VQA/GQA model, a captioner or a text-to-image model")
        if detector is None and (answerer is not None or captioner is not None):
            raise ValueError("a question-answering model or a captioner needs the detector")
        self.detector = detector
        self.answerer = answerer
        self.captioner = captioner
        self.object_names = object_names
        self.attr_names = attr_names
        self.generator = generator

    @property
    def working_size(self) -> tuple[int, int]:
        """The detector's (min_size, max_size): uploads are decoded straight to it."""
        return self.detector.config.min_size, self.detector.config.max_size

    def detect(
        self, images: list[np.ndarray], ids: list[str], original_sizes: list[tuple[int, int]] | None = None
    ) -> list[RegionFeatures]:
        """Regions of each BGR uint8 image, the images run through the detector as one batch; with
        `original_sizes`, the images are at the working size and boxes come back in the originals' pixels."""
        return self.detector.detect(images, ids=ids, original_sizes=original_sizes)

    def answer(self, regions: RegionFeatures, question: str, top_k: int) -> Answered:
        """The model's answers to `question` about the image whose detector output is `regions`."""
        if self.answerer is None:
            raise LookupError("this server holds no question-answering model")
        result = ask(self.answerer.tuned, regions, question, top_k)
        return Answered(result.answers, np.asarray(result.attention, dtype=np.float32))

    def caption(self, regions: RegionFeatures, beam_size: int) -> CaptionResult:
        """The captioner's description of the image whose detector output is `regions`."""
        if self.captioner is None:
            raise LookupError("this server holds no captioner")
        return caption_regions(self.captioner.tuned, regions, beam_size)

    def describe(self) -> dict:
        """What is loaded, for `GET /api/health`."""
        generate = self.generator.describe() if self.generator is not None else None
        if self.detector is None:
            return {"model": None, "caption": None, "detector": None, "labels": False, "generate": generate}
        provenance = self.detector.provenance()
        model = None
        if self.answerer is not None:
            answers = self.answerer.tuned.answers
            model = {**self.answerer.describe(), "answers": len(answers) if answers is not None else 0}
        return {
            "model": model,
            "caption": self.captioner.describe() if self.captioner is not None else None,
            "detector": {
                "preset": provenance["preset"],
                "weights": provenance["weights"],
                "min_size": provenance["config"]["min_size"],
                "max_size": provenance["config"]["max_size"],
                "max_boxes": provenance["max_boxes"],
            },
            "labels": self.object_names is not None,
            "generate": generate,
        }


def load_backend(
    checkpoint: str | Path | None,
    detector_weights: str | None = None,
    device: str = DEFAULT_DEVICE,
    vocab: str | Path | None = None,
    caption_checkpoint: str | Path | None = None,
    generate_checkpoint: str | Path | None = None,
    **detector_overrides,
) -> Backend:
    """Load the fine-tuned `checkpoint` (VQA/GQA, or a captioner) and `caption_checkpoint`, the detector
    their features were made with (or `detector_weights`) and, from the `vocab` folder, the VG object and
    attribute names, and the DALL-E run `generate_checkpoint`; refuse what can neither answer questions,
    describe images nor draw them."""
    generator = HeldGenerator.load(generate_checkpoint) if generate_checkpoint is not None else None
    if checkpoint is None and caption_checkpoint is None and generator is not None:
        return Backend(None, generator=generator)
    answerer = captioner = None
    device = pick_device(device)
    for path, captioner_only in ((checkpoint, False), (caption_checkpoint, True)):
        if path is None:
            continue
        tuned = load_finetuned(path, device)
        held = Held(tuned, str(path))
        if issubclass(tuned.kind, CaptionTask):
            if captioner is not None:
                raise ValueError(f"{checkpoint} and {caption_checkpoint} are both captioners; give one")
            captioner = held
        elif captioner_only:
            raise ValueError(f"--caption-checkpoint {path} is a {tuned.task} model, not a captioner")
        elif tuned.answers is None:
            raise ValueError(
                f"{path} is a {tuned.task} model; `xmodal serve` needs a VQA or GQA checkpoint "
                "(NLVR2 models judge statements about image pairs) or a captioner"
            )
        else:
            answerer = held
    if answerer is None and captioner is None:
        raise ValueError(
            "give --checkpoint (a VQA/GQA model or a captioner), --caption-checkpoint or "
            "--generate-checkpoint"
        )
    # the detector is the one the first model's features were made with; the other model is told if it
    # was trained on features made otherwise (its inputs then differ from its training)
    first, second = (answerer, captioner) if answerer is not None else (captioner, None)
    detector = build_detector(first.tuned, detector_weights, device, **detector_overrides)
    if second is not None:
        mine = detector_settings(first.tuned, detector_weights, **detector_overrides)
        theirs = detector_settings(second.tuned, detector_weights, **detector_overrides)
        if mine != theirs:
            changed = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            log.warning(
                "%s was trained on features from other detector settings (%s) than %s: it sees the "
                "regions of %s's detector",
                second.checkpoint,
                ", ".join(changed),
                first.checkpoint,
                first.checkpoint,
            )
    for held in (answerer, captioner):
        if held is not None and detector.feature_dim != held.tuned.model.config.visual_feat_dim:
            raise ValueError(
                f"the detector gives {detector.feature_dim}-d features but {held.checkpoint} expects "
                f"{held.tuned.model.config.visual_feat_dim}-d"
            )
    names = (detector.classes, detector.attributes)  # what trained weights carry, else (None, None)
    if vocab is not None:
        from extraction.draw import load_vg_vocab

        names = load_vg_vocab(vocab)
    return Backend(detector, answerer, captioner, *names, generator=generator)
