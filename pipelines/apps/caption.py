"""Caption one image with a fine-tuned captioner: detector regions in, a caption and its attention out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model.captioning import beam_search
from pipelines.apps.ask import build_detector
from pipelines.apps.caption_picture import draw_caption_attention
from pipelines.data.regions import pad_regions, region_arrays
from pipelines.engine.devices import DEFAULT_DEVICE, pick_device
from pipelines.tasks.caption import CaptionTask
from pipelines.tasks.finetuned import Finetuned, load_finetuned
from storage import RegionFeatures

DEFAULT_BEAM_SIZE = 3


@dataclass
class CaptionResult:
    """The best beam's caption, its words, each word's attention over the regions (W, N), the regions."""

    caption: str
    words: list[str]
    attentions: np.ndarray
    regions: RegionFeatures


@torch.no_grad()
def caption_regions(
    tuned: Finetuned, regions: RegionFeatures, beam_size: int = DEFAULT_BEAM_SIZE
) -> CaptionResult:
    """Caption the image whose detector output is `regions`."""
    if not issubclass(tuned.kind, CaptionTask):
        raise ValueError(
            f"`ask --caption` needs a captioning checkpoint; this one was tuned for {tuned.task}"
        )
    dim = tuned.model.config.visual_feat_dim
    if regions.feature_dim != dim:
        raise ValueError(f"the detector gives {regions.feature_dim}-d features but the model expects {dim}-d")
    if regions.num_boxes == 0:
        raise ValueError(f"the detector found no region in {regions.img_id!r}; nothing to describe")
    feats, boxes = region_arrays(regions)
    inputs = pad_regions([feats], [boxes]).model_inputs()
    device = next(tuned.model.parameters()).device
    beams = beam_search(
        tuned.model,
        inputs["visual_feats"].to(device),
        inputs["visual_attention_mask"].to(device),
        beam_size,
    )
    vocab = tuned.tokenizer
    words, steps = [], []
    for step, token in enumerate(beams.best[0].tolist()):
        if token == vocab.eos_id:
            break
        if token not in (vocab.pad_id, vocab.bos_id):
            words.append(vocab.words[token])
            steps.append(step)
    attentions = beams.attentions[0, 0, steps].float().cpu().numpy()
    return CaptionResult(" ".join(words), words, attentions, regions)


def caption_image(
    image: str | Path,
    checkpoint: str | Path,
    weights: str | None = None,
    explain: str | Path | None = None,
    beam_size: int = DEFAULT_BEAM_SIZE,
    device: str = DEFAULT_DEVICE,
    **detector_overrides,
) -> CaptionResult:
    """Detect regions in `image`, caption them with `checkpoint`, optionally draw the attention over time
    (one panel per word) to `explain`."""
    from extraction import load_image

    bgr = load_image(image)
    device = pick_device(device)
    tuned = load_finetuned(checkpoint, device)
    detector = build_detector(tuned, weights, device, **detector_overrides)
    (regions,) = detector.detect([bgr], ids=[Path(image).stem])
    result = caption_regions(tuned, regions, beam_size)
    if explain is not None:
        import cv2

        picture = draw_caption_attention(
            bgr, regions.boxes, (regions.img_h, regions.img_w), result.words, result.attentions
        )
        Path(explain).parent.mkdir(parents=True, exist_ok=True)
        if not cv2.imwrite(str(explain), picture):
            raise ValueError(f"could not write {explain}: use a .png or .jpg name in a writable folder")
    return result
