"""Ask a fine-tuned VQA/GQA model a question about one image: detector regions in, top answers out."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from extraction.draw import Drawing, Label
from pipelines.data.regions import image_sizes, inputs_for, pad_regions, region_arrays
from pipelines.data.text import encode_text, pad_text
from pipelines.engine.devices import DEFAULT_DEVICE, pick_device
from pipelines.tasks.finetuned import Finetuned, load_finetuned
from storage import RegionFeatures

log = logging.getLogger(__name__)

DEFAULT_TOP_K = 5


@dataclass
class AskResult:
    """Top answers with their sigmoid scores (the model is trained with per-answer BCE), the regions, and
    the model's `region_attention` over them: [CLS] in the last cross-modality layer (LXMERT) or the last
    co-attention layer (ViLBERT), mean over heads."""

    answers: list[tuple[str, float]]
    regions: RegionFeatures
    attention: np.ndarray


def detector_settings(tuned: Finetuned, weights: str | None, **overrides) -> dict:
    """`Detector.build` arguments that reproduce the extraction recorded in the run (see
    `extraction.provenance.detector_settings`); `weights` and non-None `overrides` win."""
    from extraction.provenance import detector_settings as recorded_settings

    recorded = tuned.settings.get("detector") or {}
    if "config" not in recorded:
        log.warning(
            "the fine-tuning features record no detector settings (an imported store, or one merged from "
            "stores made differently): the detector runs the %s preset's defaults, which may not be how "
            "the features were made; pass --min-size/--max-size/--weights to match them",
            recorded.get("preset") or "default",
        )
    settings = recorded_settings(recorded)
    if weights is not None:
        settings["weights"] = weights
    settings.update({k: v for k, v in overrides.items() if v is not None})
    return settings


def build_detector(tuned: Finetuned, weights: str | None = None, device: str = DEFAULT_DEVICE, **overrides):
    from extraction import Detector

    settings = detector_settings(tuned, weights, **overrides)
    return Detector.build(device=pick_device(device), **settings)


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
    sizes = image_sizes(regions.img_w, regions.img_h)
    batch.update(pad_regions([feats], [boxes], sizes=sizes).model_inputs())
    device = next(tuned.model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs_for(tuned.model, batch).items()}
    out = tuned.model(**inputs, output_attentions=True)
    scores = torch.sigmoid(out.logits[0].float())
    top = torch.topk(scores, min(top_k, scores.numel()))
    answers = [(tuned.answers.answer(int(i)), float(s)) for s, i in zip(top.values, top.indices, strict=True)]
    attention = out.region_attention[0].float().cpu().numpy()
    return AskResult(answers=answers, regions=regions, attention=attention)


RANK_COLOURS = ((0, 0, 230), (0, 140, 255), (0, 200, 200), (200, 160, 0), (200, 0, 160))  # BGR, #1 first


def draw_explanation(
    image_bgr: np.ndarray,
    result: AskResult,
    question: str,
    top: int = 5,
    object_names: list[str] | None = None,
    attr_names: list[str] | None = None,
) -> Drawing:
    """The image dimmed outside the `top` most attended regions, each of those boxed and labelled with
    its rank and attention weight; above, the question, the best answer and the ranking with the regions'
    "attribute object confidence" labels as detection pictures give them (ids without vocabularies)."""
    from extraction.draw import draw_boxes, region_label

    rec = result.regions
    h, w = image_bgr.shape[:2]
    order = [int(i) for i in np.argsort(-result.attention, kind="stable")[: min(top, rec.num_boxes)]]
    heat = np.zeros((h, w), np.float32)
    sx, sy = w / rec.img_w, h / rec.img_h
    for i in order:
        x1, y1, x2, y2 = rec.boxes[i]
        rows = slice(int(y1 * sy), int(np.ceil(y2 * sy)))
        heat[rows, int(x1 * sx) : int(np.ceil(x2 * sx))] += result.attention[i]
    heat /= max(float(heat.max()), 1e-12)
    shaded = (image_bgr.astype(np.float32) * (0.3 + 0.7 * heat[..., None])).astype(np.uint8)
    colours = [RANK_COLOURS[k % len(RANK_COLOURS)] for k in range(len(order))]
    weights = [float(result.attention[i]) for i in order]
    texts = [f"#{k} {weight:.2f}" for k, weight in enumerate(weights, 1)]
    answer, prob = result.answers[0]
    header = [(f"Q: {question}", (0, 0, 0)), (f"A: {answer} ({prob:.2f})", (0, 0, 0))]
    over = f"answer's attention over all {rec.num_boxes} regions (any detector confidence)"
    header.append((f"{over}, top {len(order)}:", (90, 90, 90)))
    # each region's detector confidence beside its name, as detection pictures label a box: one box reads
    # the same on both, and those a confidence threshold leaves out of a detection picture show as such
    header += [
        (
            f"#{k}  {weight:.2f}  {region_label(rec, i, object_names, attr_names)} "
            f"{float(rec.objects_conf[i]):.2f}",
            colour,
        )
        for k, (i, weight, colour) in enumerate(zip(order, weights, colours, strict=True), 1)
    ]
    drawing = draw_boxes(shaded, rec.boxes[order], (rec.img_h, rec.img_w), texts, colours, header)
    drawing.labels = [
        Label(lb.text, order[lb.region] if lb.region >= 0 else -1, lb.box, lb.in_legend)
        for lb in drawing.labels
    ]
    return drawing


def ask_image(
    image: str | Path,
    question: str,
    checkpoint: str | Path,
    weights: str | None = None,
    top_k: int = DEFAULT_TOP_K,
    explain: str | Path | None = None,
    device: str = DEFAULT_DEVICE,
    object_names: list[str] | None = None,
    attr_names: list[str] | None = None,
    **detector_overrides,
) -> AskResult:
    """Detect regions in `image`, answer `question` with the fine-tuned `checkpoint`, optionally draw
    the attended regions to `explain` (named with the VG vocabularies when given)."""
    from extraction import load_image

    bgr = load_image(image)
    device = pick_device(device)
    tuned = load_finetuned(checkpoint, device)
    detector = build_detector(tuned, weights, device, **detector_overrides)
    (regions,) = detector.detect([bgr], ids=[Path(image).stem])
    result = ask(tuned, regions, question, top_k)
    if explain is not None:
        import cv2

        if object_names is None and detector.classes is not None:  # names the trained weights carry
            object_names, attr_names = detector.classes, detector.attributes

        picture = draw_explanation(
            bgr, result, question, object_names=object_names, attr_names=attr_names
        ).image
        Path(explain).parent.mkdir(parents=True, exist_ok=True)
        if not cv2.imwrite(str(explain), picture):
            raise ValueError(f"could not write {explain}: use a .png or .jpg name in a writable folder")
    return result
