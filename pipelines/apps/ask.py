"""Ask a fine-tuned VQA/GQA model a question about one image: detector regions in, top answers out."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipelines.data.regions import pad_regions, region_arrays
from pipelines.data.text import encode_text, pad_text
from pipelines.tasks.finetuned import Finetuned, load_finetuned
from storage import RegionFeatures

log = logging.getLogger(__name__)

DEFAULT_TOP_K = 5
DEFAULT_DEVICE = "cpu"


@dataclass
class AskResult:
    """Top answers with their sigmoid scores (the model is trained with per-answer BCE), the regions, and
    the [CLS] token's attention over them in the last cross-modality layer (mean over heads)."""

    answers: list[tuple[str, float]]
    regions: RegionFeatures
    attention: np.ndarray


def detector_settings(tuned: Finetuned, weights: str | None, **overrides) -> dict:
    """`Detector.build` arguments that reproduce the extraction recorded in the run (see
    `extraction.provenance.detector_settings`); `weights` and non-None `overrides` win."""
    from extraction.provenance import detector_settings as recorded_settings

    settings = recorded_settings(tuned.settings.get("detector") or {})
    if weights is not None:
        settings["weights"] = weights
    settings.update({k: v for k, v in overrides.items() if v is not None})
    return settings


def build_detector(tuned: Finetuned, weights: str | None = None, device: str = DEFAULT_DEVICE, **overrides):
    from extraction import Detector

    settings = detector_settings(tuned, weights, **overrides)
    if settings["weights"] is None:
        log.warning(
            "no detector weights (--weights): RANDOM detector weights; the regions and answers are "
            "meaningless for real use"
        )
    return Detector.build(device=device, **settings)


@torch.no_grad()
def ask(tuned: Finetuned, regions: RegionFeatures, question: str, top_k: int = DEFAULT_TOP_K) -> AskResult:
    """Answer `question` about the image whose detector output is `regions`."""
    if tuned.answers is None:
        raise ValueError(
            f"`ask` needs a question-answering checkpoint (VQA, GQA); a {tuned.task} model has no "
            "answer table"
        )
    dim = tuned.model.config.visual_feat_dim
    if regions.feature_dim != dim:
        raise ValueError(f"the detector gives {regions.feature_dim}-d features but the model expects {dim}-d")
    if regions.num_boxes == 0:
        raise ValueError(f"the detector found no region in {regions.img_id!r}; nothing to look at")
    feats, boxes = region_arrays(regions)
    batch = pad_text([encode_text(tuned.tokenizer, question, tuned.max_length)], tuned.tokenizer.pad_token_id)
    batch.update(pad_regions([feats], [boxes]).model_inputs())
    device = next(tuned.model.parameters()).device
    inputs = {k: v.to(device) for k, v in batch.items()}
    out = tuned.model(**inputs, output_attentions=True)
    scores = torch.sigmoid(out.logits[0].float())
    top = torch.topk(scores, min(top_k, scores.numel()))
    answers = [(tuned.answers.answer(int(i)), float(s)) for s, i in zip(top.values, top.indices, strict=True)]
    attention = out.attentions[-1][0, :, 0, :].float().mean(dim=0).cpu().numpy()
    return AskResult(answers=answers, regions=regions, attention=attention)


def draw_explanation(image_bgr: np.ndarray, result: AskResult, question: str, top: int = 5) -> np.ndarray:
    """The image dimmed outside the `top` most attended regions, those regions boxed with their rank and
    attention weight, and the question with the best answer written above."""
    import cv2

    from extraction.draw import draw_regions

    rec = result.regions
    h, w = image_bgr.shape[:2]
    enlarge = 480 / min(h, w)  # small images (the demo's 96 px) are enlarged so the labels stay legible
    if enlarge > 1:
        image_bgr = cv2.resize(
            image_bgr, (round(w * enlarge), round(h * enlarge)), interpolation=cv2.INTER_NEAREST
        )
        h, w = image_bgr.shape[:2]
    order = np.argsort(-result.attention)[: min(top, rec.num_boxes)]
    heat = np.zeros((h, w), np.float32)
    sx, sy = w / rec.img_w, h / rec.img_h
    for i in order:
        x1, y1, x2, y2 = rec.boxes[i]
        heat[int(y1 * sy) : int(np.ceil(y2 * sy)), int(x1 * sx) : int(np.ceil(x2 * sx))] += result.attention[
            i
        ]
    heat /= max(float(heat.max()), 1e-12)
    shaded = (image_bgr.astype(np.float32) * (0.3 + 0.7 * heat[..., None])).astype(np.uint8)
    subset = RegionFeatures(
        img_id=rec.img_id,
        img_h=rec.img_h,
        img_w=rec.img_w,
        boxes=rec.boxes[order],
        features=rec.features[order],
        objects_id=rec.objects_id[order],
        objects_conf=rec.objects_conf[order],
        attrs_id=rec.attrs_id[order],
        attrs_conf=rec.attrs_conf[order],
    )
    drawn = draw_regions(shaded, subset)
    scale = max(0.4, min(h, w) / 800)
    for rank, i in enumerate(order, 1):
        x1, _, _, y2 = rec.boxes[i]
        org = (int(x1 * sx) + 2, max(int(y2 * sy) - 4, 10))
        cv2.putText(
            drawn,
            f"#{rank} {result.attention[i]:.2f}",
            org,
            cv2.FONT_HERSHEY_SIMPLEX,
            scale,
            (0, 255, 255),
            1,
            cv2.LINE_AA,
        )
    answer, prob = result.answers[0]
    lines = [f"Q: {question}", f"A: {answer} ({prob:.2f})"]
    font, line_h = cv2.FONT_HERSHEY_SIMPLEX, 28
    bar = np.full((line_h * len(lines) + 8, w, 3), 255, np.uint8)
    for k, text in enumerate(lines, 1):
        fit = min(0.7, 0.7 * (w - 10) / cv2.getTextSize(text, font, 0.7, 1)[0][0])  # shrink long questions
        cv2.putText(bar, text, (5, line_h * k), font, fit, (0, 0, 0), 1, cv2.LINE_AA)
    return np.concatenate([bar, drawn], axis=0)


def ask_image(
    image: str | Path,
    question: str,
    checkpoint: str | Path,
    weights: str | None = None,
    top_k: int = DEFAULT_TOP_K,
    explain: str | Path | None = None,
    device: str = DEFAULT_DEVICE,
    **detector_overrides,
) -> AskResult:
    """Detect regions in `image`, answer `question` with the fine-tuned `checkpoint`, optionally draw
    the attended regions to `explain`."""
    from extraction import load_image

    bgr = load_image(image)
    tuned = load_finetuned(checkpoint, device)
    detector = build_detector(tuned, weights, device, **detector_overrides)
    (regions,) = detector.detect([bgr], ids=[Path(image).stem])
    result = ask(tuned, regions, question, top_k)
    if explain is not None:
        import cv2

        picture = draw_explanation(bgr, result, question)
        Path(explain).parent.mkdir(parents=True, exist_ok=True)
        if not cv2.imwrite(str(explain), picture):
            raise ValueError(f"could not write {explain}: use a .png or .jpg name in a writable folder")
    return result
