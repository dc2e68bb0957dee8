"""The models the server holds, through the ask app's functions: the detector and a VQA/GQA model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipelines.apps.ask import ask, build_detector
from pipelines.tasks.finetuned import Finetuned, load_finetuned
from storage import RegionFeatures

if TYPE_CHECKING:
    from extraction import Detector


@dataclass
class Answered:
    """Top answers with their scores and the answer's attention over the regions (sums to 1)."""

    answers: list[tuple[str, float]]
    attention: np.ndarray


class Backend:
    """One detector and one fine-tuned model; `detect` takes a batch, `answer` one question."""

    def __init__(
        self,
        tuned: Finetuned,
        detector: Detector,
        checkpoint: str,
        object_names: list[str] | None = None,
        attr_names: list[str] | None = None,
    ):
        self.tuned = tuned
        self.detector = detector
        self.checkpoint = checkpoint
        self.object_names = object_names
        self.attr_names = attr_names

    def detect(self, images: list[np.ndarray], ids: list[str]) -> list[RegionFeatures]:
        """Regions of each BGR uint8 image, the images run through the detector as one batch."""
        return self.detector.detect(images, ids=ids)

    def answer(self, regions: RegionFeatures, question: str, top_k: int) -> Answered:
        """The model's answers to `question` about the image whose detector output is `regions`."""
        result = ask(self.tuned, regions, question, top_k)
        return Answered(result.answers, np.asarray(result.attention, dtype=np.float32))

    def describe(self) -> dict:
        """What is loaded, for `GET /api/health`."""
        provenance = self.detector.provenance()
        return {
            "model": {
                "checkpoint": self.checkpoint,
                "task": self.tuned.task,
                "answers": len(self.tuned.answers) if self.tuned.answers is not None else 0,
            },
            "detector": {
                "preset": provenance["preset"],
                "weights": provenance["weights"],
                "min_size": provenance["config"]["min_size"],
                "max_size": provenance["config"]["max_size"],
                "max_boxes": provenance["max_boxes"],
            },
            "labels": self.object_names is not None,
        }


def load_backend(
    checkpoint: str | Path,
    detector_weights: str | None = None,
    device: str = "cpu",
    vocab: str | Path | None = None,
    **detector_overrides,
) -> Backend:
    """Load the fine-tuned `checkpoint`, the detector its features were made with (or `detector_weights`)
    and, from the `vocab` folder, the VG object and attribute names; refuse what cannot answer questions."""
    tuned = load_finetuned(checkpoint, device)
    if tuned.answers is None:
        raise ValueError(
            f"{checkpoint} is a {tuned.task} model; `xmodal serve` needs a VQA or GQA checkpoint "
            "(NLVR2 models judge statements about image pairs)"
        )
    detector = build_detector(tuned, detector_weights, device, **detector_overrides)
    if detector.feature_dim != tuned.model.config.visual_feat_dim:
        raise ValueError(
            f"the detector gives {detector.feature_dim}-d features but {checkpoint} expects "
            f"{tuned.model.config.visual_feat_dim}-d"
        )
    names = (None, None)
    if vocab is not None:
        from extraction.draw import load_vg_vocab

        names = load_vg_vocab(vocab)
    return Backend(tuned, detector, str(checkpoint), *names)
