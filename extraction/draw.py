"""Drawing regions on an image with "attribute object" labels, and loading the VG vocabularies."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from storage import RegionFeatures

OBJECT_FILES = ("objects_vocab.txt", "vg_objects_vocab.txt")
ATTRIBUTE_FILES = ("attributes_vocab.txt", "vg_attributes_vocab.txt")


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


def draw_regions(
    bgr_image: np.ndarray,
    rec: RegionFeatures,
    object_names: list[str] | None = None,
    attr_names: list[str] | None = None,
) -> np.ndarray:
    """A copy of the BGR image with each region's box and "attribute object" label drawn on it."""
    out = np.ascontiguousarray(bgr_image).copy()
    h, w = out.shape[:2]
    sx, sy = w / rec.img_w, h / rec.img_h  # the stored boxes are in the extracted image's pixels
    thickness = max(1, round(min(h, w) / 300))
    font_scale = max(0.35, min(h, w) / 1000)
    for i in range(rec.num_boxes):
        x1, y1, x2, y2 = rec.boxes[i]
        p1 = (int(round(x1 * sx)), int(round(y1 * sy)))
        p2 = (int(round(x2 * sx)), int(round(y2 * sy)))
        color = _color(i)
        cv2.rectangle(out, p1, p2, color, thickness)
        text = region_label(rec, i, object_names, attr_names)
        (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, font_scale, 1)
        top = max(p1[1] - th - base, 0)
        cv2.rectangle(out, (p1[0], top), (p1[0] + tw, top + th + base), color, -1)
        cv2.putText(
            out,
            text,
            (p1[0], top + th),
            cv2.FONT_HERSHEY_SIMPLEX,
            font_scale,
            (255, 255, 255),
            1,
            cv2.LINE_AA,
        )
    return out


def _color(i: int) -> tuple[int, int, int]:
    hue = (i * 47) % 180
    bgr = cv2.cvtColor(np.uint8([[[hue, 200, 200]]]), cv2.COLOR_HSV2BGR)[0, 0]
    return int(bgr[0]), int(bgr[1]), int(bgr[2])
