"""The attention-over-time picture: one panel per generated word, lit where the captioner looked."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PANEL = 224  # each panel's shorter side in pixels
COLUMNS = 4


def attention_heat(
    boxes: np.ndarray, weights: np.ndarray, height: int, width: int, scale: tuple[float, float]
) -> np.ndarray:
    """(H, W) sum of each region's attention weight over its box, scaled to [0, 1]."""
    heat = np.zeros((height, width), np.float32)
    sx, sy = scale
    for (x1, y1, x2, y2), weight in zip(boxes, weights, strict=True):
        top, bottom = int(y1 * sy), int(np.ceil(y2 * sy))
        left, right = int(x1 * sx), int(np.ceil(x2 * sx))
        heat[max(top, 0) : max(bottom, 0), max(left, 0) : max(right, 0)] += float(weight)
    return heat / max(float(heat.max()), 1e-12)


def draw_caption_attention(
    image_bgr: np.ndarray,
    boxes: np.ndarray,
    image_size: tuple[int, int],
    words: Sequence[str],
    attentions: np.ndarray,
) -> np.ndarray:
    """A BGR grid: the image with the caption, then per word the image lit by that step's attention.

    boxes (N, 4) x1, y1, x2, y2 in the pixels of `image_size` = (height, width) that the regions were
    extracted at (grid cells are boxes too); attentions (T ≥ len(words), N) the per-step weights.
    """
    import cv2

    if attentions.ndim != 2 or attentions.shape[1] != len(boxes) or attentions.shape[0] < len(words):
        raise ValueError(
            f"attentions {attentions.shape} must be (steps ≥ {len(words)} words, {len(boxes)} regions)"
        )
    h, w = image_bgr.shape[:2]
    enlarge = PANEL / min(h, w)
    image = cv2.resize(image_bgr, (round(w * enlarge), round(h * enlarge)), interpolation=cv2.INTER_AREA)
    h, w = image.shape[:2]
    scale = (w / image_size[1], h / image_size[0])
    panels = [_label(image, " ".join(words) or "(empty caption)")]
    for t, word in enumerate(words):
        heat = attention_heat(boxes, attentions[t], h, w, scale)
        lit = (image.astype(np.float32) * (0.2 + 0.8 * heat[..., None])).astype(np.uint8)
        best = int(np.argmax(attentions[t]))
        x1, y1, x2, y2 = boxes[best]
        cv2.rectangle(
            lit,
            (int(x1 * scale[0]), int(y1 * scale[1])),
            (int(x2 * scale[0]) - 1, int(y2 * scale[1]) - 1),
            (0, 255, 255),
            2,
        )
        panels.append(_label(lit, f"{t + 1}. {word}  ({attentions[t, best]:.2f})"))
    blank = np.full_like(panels[0], 255)
    panels += [blank] * (-len(panels) % COLUMNS)
    rows = [np.concatenate(panels[i : i + COLUMNS], axis=1) for i in range(0, len(panels), COLUMNS)]
    return np.concatenate(rows, axis=0)


def _label(panel: np.ndarray, text: str) -> np.ndarray:
    """The panel with `text` on a white bar beneath it (shrunk to fit) and a thin white margin."""
    import cv2

    h, w = panel.shape[:2]
    font = cv2.FONT_HERSHEY_SIMPLEX
    size = min(0.6, 0.6 * (w - 10) / max(cv2.getTextSize(text, font, 0.6, 1)[0][0], 1))
    bar = np.full((28, w, 3), 255, np.uint8)
    cv2.putText(bar, text, (5, 20), font, size, (0, 0, 0), 1, cv2.LINE_AA)
    framed = np.concatenate([panel, bar], axis=0)
    return cv2.copyMakeBorder(framed, 4, 4, 4, 4, cv2.BORDER_CONSTANT, value=(255, 255, 255))
