"""Drawing regions on an image with labels that never overprint each other, and the VG vocabularies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from storage import RegionFeatures

OBJECT_FILES = ("objects_vocab.txt", "vg_objects_vocab.txt")
ATTRIBUTE_FILES = ("attributes_vocab.txt", "vg_attributes_vocab.txt")

# Pictures are drawn at a size where one fixed font is legible: small images are enlarged to MIN_SIDE on
# their shorter side, large ones reduced to MAX_SIDE on their longer side.
MIN_SIDE = 600
MAX_SIDE = 1600
MIN_WIDTH = 360  # a narrower picture gets a white margin on the right, room for labels and header lines
FONT = cv2.FONT_HERSHEY_SIMPLEX
FONT_SCALE = 0.5
PAD = 3  # pixels around a label's text
BOX_THICKNESS = 2

Rect = tuple[int, int, int, int]  # x1, y1, x2, y2 in picture pixels; x2, y2 exclusive


@dataclass(frozen=True)
class Label:
    """One drawn label: its text, the index of the region it names (-1 for header lines), and its
    background box in the returned picture's pixels; `in_legend` when it had no room beside its region."""

    text: str
    region: int
    box: Rect
    in_legend: bool = False


@dataclass
class Drawing:
    """A drawn picture (BGR uint8) and where every label went."""

    image: np.ndarray
    labels: list[Label]


def load_vg_vocab(directory: str | Path) -> tuple[list[str], list[str]]:
    """(object names, attribute names) from a folder with the VG vocabularies; first synonym = name."""
    directory = Path(directory)
    return _read_vocab(directory, OBJECT_FILES), _read_vocab(directory, ATTRIBUTE_FILES)


def _read_vocab(directory: Path, names: tuple[str, ...]) -> list[str]:
    for name in names:
        path = directory / name
        if path.is_file():
            lines = path.read_text(encoding="utf-8").splitlines()
            return [line.split(",")[0].strip() for line in lines if line.strip()]
    raise FileNotFoundError(f"no {' or '.join(names)} in {str(directory)!r}; pass the folder holding them")


def region_label(
    rec: RegionFeatures, i: int, object_names: list[str] | None = None, attr_names: list[str] | None = None
) -> str:
    """ "attribute object" for region i, with ids where no vocabulary is given."""
    obj, attr = int(rec.objects_id[i]), int(rec.attrs_id[i])
    obj_name = object_names[obj] if object_names and 0 <= obj < len(object_names) else f"obj{obj}"
    attr_name = attr_names[attr] if attr_names and 0 <= attr < len(attr_names) else f"attr{attr}"
    return f"{attr_name} {obj_name}"


def picture_scale(height: int, width: int, min_side: int = MIN_SIDE, max_side: int = MAX_SIDE) -> float:
    """The factor an image is drawn at: its shorter side enlarged to `min_side`, but its longer side at
    most `max_side` (a very long, thin image keeps that bound)."""
    return min(max(min_side / min(height, width), 1.0), max_side / max(height, width))


def overlaps(a: Rect, b: Rect) -> bool:
    """Whether two rectangles share any pixel."""
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def layout_labels(
    anchors: Sequence[Rect], sizes: Sequence[tuple[int, int]], width: int, height: int
) -> list[Rect | None]:
    """A place for each label (in order: earlier labels get the better places) beside its anchor box,
    inside a `width` x `height` picture and over no label placed before it; None where there is none.

    Tried in turn: above the box, inside its top, below it, inside its bottom (aligned with the box's left
    edge, then its right edge, then just outside either edge), then the nearest free height at those
    horizontal places."""
    placed = np.zeros((0, 4), np.int64)
    out: list[Rect | None] = []
    for (x1, y1, x2, y2), (w, h) in zip(anchors, sizes, strict=True):
        spot = None
        if w <= width and h <= height:
            xs = list(dict.fromkeys(min(max(x, 0), width - w) for x in (x1, x2 - w, x2, x1 - w)))
            ys = [y1 - h, y1, y2, y2 - h]
            candidates = [(x, y) for x in xs for y in ys]
            # then every height, nearest the box's top first, in half-label steps
            step = max(1, h // 2)
            heights = sorted(range(0, height - h + 1, step), key=lambda y: abs(y - (y1 - h)))
            candidates += [(x, y) for y in heights for x in xs]
            for x, y in candidates:
                if not 0 <= y <= height - h:
                    continue
                rect = (x, y, x + w, y + h)
                if not _hits(placed, rect):
                    spot = rect
                    break
        out.append(spot)
        if spot is not None:
            placed = np.vstack([placed, np.array([spot], np.int64)])
    return out


def _hits(placed: np.ndarray, rect: Rect) -> bool:
    if not len(placed):
        return False
    x1, y1, x2, y2 = rect
    return bool(np.any((placed[:, 0] < x2) & (x1 < placed[:, 2]) & (placed[:, 1] < y2) & (y1 < placed[:, 3])))


def text_size(text: str) -> tuple[int, int]:
    """Width and height of a label's background box for `text`."""
    (tw, th), base = cv2.getTextSize(text, FONT, FONT_SCALE, 1)
    return tw + 2 * PAD, th + base + 2 * PAD


def draw_boxes(
    bgr_image: np.ndarray,
    boxes: np.ndarray,
    frame: tuple[int, int],
    texts: Sequence[str],
    colours: Sequence[tuple[int, int, int]] | None = None,
    header: Sequence[tuple[str, tuple[int, int, int]]] = (),
) -> Drawing:
    """The image at a legible size (`picture_scale`) with each box (x1, y1, x2, y2 in a `frame` =
    (height, width) image, e.g. the one the regions were extracted from) outlined and labelled. Labels go
    beside their box where there is room, in the given order of priority, and to a legend under the
    image where there is not; `header` lines (text, colour) go above it. No two labels overlap."""
    image = np.ascontiguousarray(bgr_image)
    if image.ndim == 2:
        image = cv2.cvtColor(image, cv2.COLOR_GRAY2BGR)
    h, w = image.shape[:2]
    scale = picture_scale(h, w)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    interpolation = cv2.INTER_AREA if scale < 1 else cv2.INTER_CUBIC
    canvas = cv2.resize(image, size, interpolation=interpolation) if scale != 1 else image.copy()
    if size[0] < MIN_WIDTH:
        canvas = cv2.copyMakeBorder(
            canvas, 0, 0, 0, MIN_WIDTH - size[0], cv2.BORDER_CONSTANT, value=(255,) * 3
        )
    height, width = canvas.shape[:2]
    colours = list(colours) if colours is not None else [region_colour(i) for i in range(len(texts))]
    sx, sy = size[0] / frame[1], size[1] / frame[0]
    anchors: list[Rect] = []
    for (x1, y1, x2, y2), colour in zip(np.asarray(boxes, np.float64), colours, strict=True):
        rect = (round(x1 * sx), round(y1 * sy), round(x2 * sx), round(y2 * sy))
        cv2.rectangle(canvas, rect[:2], (rect[2] - 1, rect[3] - 1), colour, BOX_THICKNESS)
        anchors.append(rect)
    sizes = [text_size(t) for t in texts]
    spots = layout_labels(anchors, sizes, width, height)
    labels = []
    for i, (text, spot, colour) in enumerate(zip(texts, spots, colours, strict=True)):
        if spot is not None:
            _label(canvas, text, spot, colour)
            labels.append(Label(text, i, spot))
    left = [i for i, spot in enumerate(spots) if spot is None]
    legend, legend_labels = _legend([texts[i] for i in left], [colours[i] for i in left], left, width)
    top, header_labels = _header(header, width)
    offset = top.shape[0]
    labels = [Label(lb.text, lb.region, _shift(lb.box, offset), lb.in_legend) for lb in labels]
    legend_labels = [Label(lb.text, lb.region, _shift(lb.box, offset + height), True) for lb in legend_labels]
    picture = np.concatenate([top, canvas, legend], axis=0)
    return Drawing(picture, header_labels + labels + legend_labels)


def draw_regions(
    bgr_image: np.ndarray,
    rec: RegionFeatures,
    object_names: list[str] | None = None,
    attr_names: list[str] | None = None,
    regions: Sequence[int] | None = None,
    show_conf: bool = False,
) -> Drawing:
    """The image with the record's regions (all, or `regions` in that order of priority) outlined and
    labelled "attribute object" (with the object confidence when `show_conf`)."""
    regions = list(range(rec.num_boxes)) if regions is None else [int(i) for i in regions]
    texts = []
    for i in regions:
        text = region_label(rec, i, object_names, attr_names)
        texts.append(f"{text} {float(rec.objects_conf[i]):.2f}" if show_conf else text)
    colours = [region_colour(i) for i in regions]
    drawing = draw_boxes(bgr_image, rec.boxes[regions], (rec.img_h, rec.img_w), texts, colours)
    # report region indices of the record, not positions in `regions`
    drawing.labels = [
        Label(lb.text, regions[lb.region] if lb.region >= 0 else -1, lb.box, lb.in_legend)
        for lb in drawing.labels
    ]
    return drawing


def region_colour(i: int) -> tuple[int, int, int]:
    """A saturated BGR colour per region index, neighbours far apart in hue."""
    hue = (i * 47) % 180
    bgr = cv2.cvtColor(np.uint8([[[hue, 220, 210]]]), cv2.COLOR_HSV2BGR)[0, 0]
    return int(bgr[0]), int(bgr[1]), int(bgr[2])


def _text_colour(background: tuple[int, int, int]) -> tuple[int, int, int]:
    b, g, r = background
    return (0, 0, 0) if 0.114 * b + 0.587 * g + 0.299 * r > 140 else (255, 255, 255)


def _label(canvas: np.ndarray, text: str, rect: Rect, colour: tuple[int, int, int]) -> None:
    x1, y1, x2, y2 = rect
    cv2.rectangle(canvas, (x1, y1), (x2 - 1, y2 - 1), colour, -1)
    (_, th), _ = cv2.getTextSize(text, FONT, FONT_SCALE, 1)
    cv2.putText(
        canvas, text, (x1 + PAD, y1 + PAD + th), FONT, FONT_SCALE, _text_colour(colour), 1, cv2.LINE_AA
    )


def _legend(
    texts: list[str], colours: list[tuple[int, int, int]], regions: list[int], width: int
) -> tuple[np.ndarray, list[Label]]:
    """Labels without room beside their box, flowed left to right in rows under the image."""
    if not texts:
        return np.zeros((0, width, 3), np.uint8), []
    x, y, row_h, rects = PAD, PAD, 0, []
    for text in texts:
        w, h = text_size(text)
        w = min(w, width - 2 * PAD)
        if x + w > width - PAD and x > PAD:
            x, y, row_h = PAD, y + row_h + PAD, 0
        rects.append((x, y, x + w, y + h))
        x, row_h = x + w + PAD, max(row_h, h)
    panel = np.full((y + row_h + PAD, width, 3), 255, np.uint8)
    labels = []
    for text, rect, colour, region in zip(texts, rects, colours, regions, strict=True):
        _label(panel, text, rect, colour)
        labels.append(Label(text, region, rect, True))
    return panel, labels


def _header(lines: Sequence[tuple[str, tuple[int, int, int]]], width: int) -> tuple[np.ndarray, list[Label]]:
    """Lines of text on white above the image, each shrunk to the width if it is longer."""
    line_h = text_size("Ag")[1] + 4
    panel = np.full((line_h * len(lines) + (PAD if lines else 0), width, 3), 255, np.uint8)
    labels = []
    for k, (text, colour) in enumerate(lines):
        (tw, th), _ = cv2.getTextSize(text, FONT, FONT_SCALE, 1)
        fit = min(FONT_SCALE, FONT_SCALE * (width - 2 * PAD) / max(tw, 1))
        y = PAD + k * line_h
        cv2.putText(panel, text, (PAD, y + th + PAD), FONT, fit, colour, 1, cv2.LINE_AA)
        labels.append(Label(text, -1, (0, y, width, y + line_h)))
    return panel, labels


def _shift(rect: Rect, dy: int) -> Rect:
    return rect[0], rect[1] + dy, rect[2], rect[3] + dy
