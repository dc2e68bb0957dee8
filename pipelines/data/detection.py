"""Detector training data: COCO detection JSON (+ attributes) in, resized and flipped image batches out,
and Visual Genome's own files converted to that JSON."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch
from torch.utils.data import Dataset

from extraction.preprocess import batch_images, load_image, resize_image
from model.files import read_text
from pipelines.data.json_rows import read_json

log = logging.getLogger(__name__)

COUNT_KEYS = ("clipped", "zero_area", "unknown_category", "crowd", "unknown_attribute")
# far above any real image (COCO's most is 93, Visual Genome's a few hundred); every box is matched
# against every anchor, so a million on one image would fill memory long before the first step
MAX_BOXES_PER_IMAGE = 2000


@dataclass
class ImageAnnotation:
    """One image's boxes (N, 4) float32 x1y1x2y2 in original pixels, classes (N,) int64 and
    attributes (N, K) int64 padded with -1."""

    image_id: int
    file_name: str
    path: Path
    width: int
    height: int
    boxes: np.ndarray
    classes: np.ndarray
    attributes: np.ndarray


@dataclass
class DetectionData:
    """A loaded detection set: class and attribute names (contiguous indices), images, skip counts."""

    classes: list[str]
    attributes: list[str]
    images: list[ImageAnnotation]
    counts: dict[str, int]

    def to_coco_gt(self) -> dict:
        """The kept boxes as a COCO dict for pycocotools: category id = class index + 1, iscrowd 0."""
        annotations = []
        for img in self.images:
            for box, cls in zip(img.boxes.tolist(), img.classes.tolist(), strict=True):
                w, h = box[2] - box[0], box[3] - box[1]
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": img.image_id,
                        "category_id": cls + 1,
                        "bbox": [box[0], box[1], w, h],
                        "area": w * h,
                        "iscrowd": 0,
                    }
                )
        return {
            "images": [
                {"id": i.image_id, "file_name": i.file_name, "width": i.width, "height": i.height}
                for i in self.images
            ],
            "annotations": annotations,
            "categories": [{"id": i + 1, "name": name} for i, name in enumerate(self.classes)],
        }


def _rows(data: dict, key: str, path: Path, where: str = "the file", required: bool = True) -> list[dict]:
    if key not in data:
        if not required:
            return []
        raise ValueError(f"{path}: {where} has no {key!r} key; is this the right file?")
    rows = data[key]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: {where} key {key!r} must be a list of objects; fix the file")
    return rows


def _get(row: dict, key: str, kind: type | tuple[type, ...], path: Path, where: str):
    if key not in row:
        raise ValueError(f"{path}: {where} has no {key!r} key; fix the file")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{path}: {where} key {key!r} is {value!r}, of the wrong type; fix the file")
    return value


def _names_by_id(rows: list[dict], section: str, path: Path) -> tuple[list[str], dict[int, int]]:
    """Names in ascending id order and id -> contiguous index."""
    names: dict[int, str] = {}
    for n, row in enumerate(rows):
        where = f"{section}[{n}]"
        ident = _get(row, "id", int, path, where)
        if ident in names:
            raise ValueError(f"{path}: {section} id {ident} appears twice; give each entry its own id")
        names[ident] = _get(row, "name", str, path, where)
    ids = sorted(names)
    return [names[i] for i in ids], {ident: index for index, ident in enumerate(ids)}


def _bbox(ann: dict, path: Path, where: str) -> tuple[float, float, float, float]:
    box = _get(ann, "bbox", list, path, where)
    if len(box) != 4 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in box):
        raise ValueError(f"{path}: {where} bbox {box!r} is not [x, y, w, h] numbers; fix the file")
    if not all(math.isfinite(v) for v in box):
        raise ValueError(f"{path}: {where} bbox {box!r} holds a non-finite number; fix the file")
    x, y, w, h = (float(v) for v in box)
    return x, y, x + w, y + h


class _AnnotationReader:
    """Turns annotations into kept (image id, box, class, attributes) rows, counting what is clipped,
    skipped or dropped; with strict, the first such problem raises instead."""

    def __init__(
        self,
        path: Path,
        strict: bool,
        sizes: dict[int, tuple[int, int]],
        class_index: dict[int, int],
        attribute_index: dict[int, int],
    ) -> None:
        self.path, self.strict, self.sizes = path, strict, sizes
        self.class_index, self.attribute_index = class_index, attribute_index
        self.counts = dict.fromkeys(COUNT_KEYS, 0)

    def problem(self, kind: str, ann_id: object, what: str, fix: str) -> None:
        if self.strict:
            raise ValueError(f"{self.path}: annotation {ann_id} {what}; {fix} (or load without strict)")
        self.counts[kind] += 1

    def read(self, ann: dict, n: int) -> tuple[int, list[float], int, list[int]] | None:
        path = self.path
        ann_id = _get(ann, "id", (int, str), path, f"annotations[{n}]")
        where = f"annotation {ann_id}"
        image_id = _get(ann, "image_id", int, path, where)
        if image_id not in self.sizes:
            raise ValueError(f"{path}: {where} names image_id {image_id}, which is not in 'images'")
        category = _get(ann, "category_id", int, path, where)
        box = _bbox(ann, path, where)
        attribute_ids = ann.get("attribute_ids", [])
        if not isinstance(attribute_ids, list) or not all(
            isinstance(a, int) and not isinstance(a, bool) for a in attribute_ids
        ):
            raise ValueError(f"{path}: {where} 'attribute_ids' must be a list of integers; fix the file")
        if "iscrowd" in ann and _get(ann, "iscrowd", int, path, where):
            self.problem("crowd", ann_id, "is a crowd box (iscrowd=1)", "drop it from the file")
            return None
        if category not in self.class_index:
            self.problem(
                "unknown_category",
                ann_id,
                f"has category_id {category}, which is not in 'categories'",
                "add the category or drop the annotation",
            )
            return None
        kept = self.clip(box, *self.sizes[image_id], ann_id)
        if kept is None:
            return None
        known = []
        for a in attribute_ids:
            if a in self.attribute_index:
                known.append(self.attribute_index[a])
            else:
                self.problem(
                    "unknown_attribute",
                    ann_id,
                    f"has attribute id {a}, which is not in 'attributes'",
                    "add the attribute or remove the id",
                )
        return image_id, kept, self.class_index[category], list(dict.fromkeys(known))

    def clip(
        self, box: tuple[float, float, float, float], width: int, height: int, ann_id: object
    ) -> list[float] | None:
        """The box clipped to [0, width] x [0, height], or None when nothing of positive area is left."""
        x1, y1, x2, y2 = box
        clipped = [min(max(x1, 0.0), width), min(max(y1, 0.0), height)]
        clipped += [min(max(x2, 0.0), width), min(max(y2, 0.0), height)]
        if clipped[2] <= clipped[0] or clipped[3] <= clipped[1]:
            self.problem(
                "zero_area",
                ann_id,
                f"box {list(box)} has no area inside the {width}x{height} image",
                "fix or drop the box",
            )
            return None
        if clipped != list(box):
            self.problem(
                "clipped",
                ann_id,
                f"box {list(box)} reaches outside the {width}x{height} image",
                "clip it to the image",
            )
        return clipped


def load_detection_json(path: str | Path, images_dir: str | Path, strict: bool = False) -> DetectionData:
    """Read a COCO detection JSON (with optional `attribute_ids` per annotation and top-level
    `attributes`); boxes are clipped to their image, crowd, zero-area and unknown-category boxes are
    skipped and unknown attribute ids dropped, each counted (strict: the first one raises). Refused in one
    line: no categories, a file_name outside `images_dir`, more than MAX_BOXES_PER_IMAGE boxes on an image."""
    path, images_dir = Path(path), Path(images_dir)
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a COCO detection object, got a JSON {type(data).__name__}")
    classes, class_index = _names_by_id(_rows(data, "categories", path), "categories", path)
    if not classes:
        raise ValueError(f"{path}: 'categories' is empty: a detector needs at least one class; list them")
    attributes, attribute_index = _names_by_id(
        _rows(data, "attributes", path, required=False), "attributes", path
    )
    images = _read_images(_rows(data, "images", path), path, images_dir)
    sizes = {image_id: (width, height) for image_id, _, width, height in images}
    reader = _AnnotationReader(path, strict, sizes, class_index, attribute_index)
    per_image: dict[int, list[tuple[list[float], int, list[int]]]] = {image_id: [] for image_id in sizes}
    for n, ann in enumerate(_rows(data, "annotations", path)):
        row = reader.read(ann, n)
        if row is not None:
            boxes = per_image[row[0]]
            if len(boxes) == MAX_BOXES_PER_IMAGE:
                raise ValueError(
                    f"{path}: image {row[0]} has more than {MAX_BOXES_PER_IMAGE} boxes (annotation "
                    f"{ann.get('id')!r} is one too many); no image holds that many objects: fix the file"
                )
            boxes.append(row[1:])
    annotated = [
        ImageAnnotation(image_id, name, images_dir / name, width, height, *_stack(per_image[image_id]))
        for image_id, name, width, height in images
    ]
    return DetectionData(classes, attributes, annotated, reader.counts)


def _read_images(rows: list[dict], path: Path, images_dir: Path) -> list[tuple[int, str, int, int]]:
    """(image id, file name, width, height) per image; every file must exist under `images_dir`."""
    images: list[tuple[int, str, int, int]] = []
    seen: set[int] = set()
    missing: list[str] = []
    for n, row in enumerate(rows):
        where = f"images[{n}]"
        image_id = _get(row, "id", int, path, where)
        if image_id in seen:
            raise ValueError(f"{path}: image id {image_id} appears twice; give each image its own id")
        seen.add(image_id)
        file_name = _get(row, "file_name", str, path, where)
        if (
            PurePosixPath(file_name).is_absolute()
            or ".." in PurePosixPath(file_name.replace("\\", "/")).parts
        ):
            raise ValueError(
                f"{path}: image {image_id} file_name {file_name!r} leaves the images folder {images_dir} "
                "(an absolute path or '..'); give paths relative to it"
            )
        width, height = (_get(row, key, int, path, where) for key in ("width", "height"))
        if width <= 0 or height <= 0:
            raise ValueError(f"{path}: image {image_id} is {width}x{height}; fix its width and height")
        if not (images_dir / file_name).is_file():
            missing.append(file_name)
        images.append((image_id, file_name, width, height))
    if missing:
        raise ValueError(
            f"{path}: {len(missing)} of {len(rows)} image files are missing under {images_dir}, first "
            f"{missing[0]!r}; check images_dir or remove those images from the file"
        )
    return images


def _stack(rows: list[tuple[list[float], int, list[int]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    width = max([1, *(len(attrs) for _, _, attrs in rows)])
    attributes = np.full((len(rows), width), -1, dtype=np.int64)
    for i, (_, _, attrs) in enumerate(rows):
        attributes[i, : len(attrs)] = attrs
    boxes = np.array([box for box, _, _ in rows], dtype=np.float32).reshape(-1, 4)
    return boxes, np.array([cls for _, cls, _ in rows], dtype=np.int64), attributes


class DetectionDataset(Dataset):
    """Item i: the decoded BGR uint8 image and its boxes, classes and attributes in original pixels."""

    def __init__(self, data: DetectionData) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data.images)

    def __getitem__(self, index: int) -> dict:
        ann = self.data.images[index]
        image = load_image(ann.path)
        height, width = image.shape[:2]
        if (width, height) != (ann.width, ann.height):
            # the boxes were clipped to the annotated size: a different decoded size means they are wrong
            raise ValueError(
                f"image {str(ann.path)!r} (image id {ann.image_id}) decodes to {width}x{height} but is "
                f"annotated as {ann.width}x{ann.height}; fix its width and height in the JSON"
            )
        return {
            "index": index,
            "image_id": ann.image_id,
            "image": image,
            "boxes": ann.boxes,
            "classes": ann.classes,
            "attributes": ann.attributes,
            "orig_hw": (height, width),
        }


class DetectionCollate:
    """Resize (shortest edge from `min_sizes`, longest <= `max_size`), maybe flip, normalise; no padding.

    Training draws, per image in order, the shortest edge uniformly from `min_sizes` and then a flip
    with probability `flip_prob`, both from the `rng` given to each call. Evaluation takes one size
    (the test size) and never flips, so it needs no rng.
    """

    def __init__(
        self,
        min_sizes: Sequence[int],
        max_size: int,
        flip_prob: float,
        pixel_mean: Sequence[float],
        pixel_std: Sequence[float],
        train: bool = True,
    ) -> None:
        if not min_sizes or any(s <= 0 for s in min_sizes) or max_size <= 0:
            raise ValueError(f"sizes must be positive: min_sizes={min_sizes}, max_size={max_size}")
        if not 0.0 <= flip_prob <= 1.0:
            raise ValueError(f"flip_prob must be in [0, 1], got {flip_prob}")
        if not train and (len(min_sizes) != 1 or flip_prob != 0):
            raise ValueError(
                f"evaluation takes one min size (the test size) and flip_prob 0, got min_sizes={min_sizes} "
                f"and flip_prob={flip_prob}"
            )
        self.min_sizes = tuple(int(s) for s in min_sizes)
        self.max_size = int(max_size)
        self.flip_prob = float(flip_prob)
        self.pixel_mean = tuple(float(v) for v in pixel_mean)
        self.pixel_std = tuple(float(v) for v in pixel_std)
        self.train = train

    def __call__(self, items: list[dict], rng: np.random.Generator | None = None) -> dict:
        if self.train and rng is None:
            raise ValueError("training collate needs an rng for its sizes and flips")
        images, targets, scales, orig_hw = [], [], [], []
        for item in items:
            min_size, flip = self.min_sizes[0], False
            if self.train:
                min_size = self.min_sizes[int(rng.integers(len(self.min_sizes)))]
                flip = bool(rng.random() < self.flip_prob)
            image, boxes, scale = self._transform(item["image"], item["boxes"], min_size, flip)
            normalised, _ = batch_images([image], self.pixel_mean, self.pixel_std, torch.device("cpu"))
            images.append(normalised[0])
            targets.append(
                {
                    "boxes": torch.from_numpy(boxes),
                    "classes": torch.as_tensor(item["classes"], dtype=torch.int64),
                    "attributes": torch.as_tensor(item["attributes"], dtype=torch.int64),
                }
            )
            scales.append(scale)
            orig_hw.append(item["orig_hw"])
        return {
            "images": images,
            "targets": targets,
            "image_ids": torch.tensor([item["image_id"] for item in items], dtype=torch.int64),
            "scale": torch.tensor(scales, dtype=torch.float32).reshape(-1, 2),
            "orig_hw": torch.tensor(orig_hw, dtype=torch.int64).reshape(-1, 2),
        }

    def _transform(
        self, image: np.ndarray, boxes: np.ndarray, min_size: int, flip: bool
    ) -> tuple[np.ndarray, np.ndarray, tuple[float, float]]:
        height, width = image.shape[:2]
        resized = resize_image(image, min_size, self.max_size)
        new_h, new_w = resized.shape[:2]
        sx, sy = new_w / width, new_h / height
        out = np.asarray(boxes, dtype=np.float64).reshape(-1, 4) * np.array([sx, sy, sx, sy])
        if flip:
            resized = resized[:, ::-1]
            out = np.stack([new_w - out[:, 2], out[:, 1], new_w - out[:, 0], out[:, 3]], axis=1)
        return np.ascontiguousarray(resized), out.astype(np.float32), (sx, sy)


# bottom-up-attention's setup_vg.py: an object name whose leading words are all among these is
# the last word, and the leading words become its attributes ("white dog" -> dog + white)
_COMMON_ATTRIBUTES = frozenset(
    [
        "white",
        "black",
        "blue",
        "green",
        "red",
        "brown",
        "yellow",
        "small",
        "large",
        "silver",
        "wooden",
        "orange",
        "gray",
        "grey",
        "metal",
        "pink",
        "tall",
        "long",
        "dark",
    ]
)


def _clean(text: str) -> str:
    text = text.lower().strip()
    return text[:-1].strip() if text.endswith(".") else text


def _object_name(raw: str) -> tuple[str, list[str]]:
    """(object name, attributes taken from its leading adjectives)."""
    name = _clean(raw)
    words = name.split()
    if len(words) > 1 and all(w in _COMMON_ATTRIBUTES for w in words[:-1]):
        return words[-1], words[:-1]
    return name, []


def _attribute_names(raw: str) -> list[str]:
    text = _clean(raw)
    if text == "black and white":
        return [text]
    return [part.strip() for part in text.split(" and ")]


def read_vocab(path: str | Path) -> tuple[list[str], dict[str, int]]:
    """A vocab file (one class per line, comma-separated synonyms, the first is the name):
    (names, every lower-cased synonym -> line index)."""
    path = Path(path)
    # a regular file of a plausible size, UTF-8: a FIFO would hang here and /dev/zero never end
    lines = read_text(path, "vocab").splitlines()
    names: list[str] = []
    index: dict[str, int] = {}
    for n, line in enumerate(lines):
        synonyms = [s.lower().strip() for s in line.split(",")]
        if not synonyms[0]:
            raise ValueError(f"{path}: line {n + 1} has no name; remove the empty line")
        names.append(synonyms[0])
        for s in synonyms:
            index[s] = n
    return names, index


def _vg_list(path: Path, what: str) -> list[dict]:
    data = read_json(path)
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected Visual Genome's {what} (a JSON list of objects)")
    return data


def _vg_sizes(path: Path) -> dict[int, tuple[int, int]]:
    """image_data.json: image id -> (width, height)."""
    sizes = {}
    rows: dict[int, int] = {}
    for n, row in enumerate(_vg_list(path, "image_data.json")):
        where = f"row {n}"
        image_id = _get(row, "image_id", int, path, where)
        if image_id in rows:
            raise ValueError(
                f"{path}: rows {rows[image_id]} and {n} both describe image {image_id}; keep one of them"
            )
        rows[image_id] = n
        size = sizes[image_id] = (_get(row, "width", int, path, where), _get(row, "height", int, path, where))
        if min(size) <= 0:
            raise ValueError(f"{path}: image {image_id} is {size[0]}x{size[1]}; fix its width and height")
    return sizes


def _vg_attributes(path: Path) -> dict[tuple[int, int], list[str]]:
    """attributes.json: (image id, object id) -> the object's raw attribute strings."""
    out: dict[tuple[int, int], list[str]] = {}
    for n, row in enumerate(_vg_list(path, "attributes.json")):
        image_id = _get(row, "image_id", int, path, f"row {n}")
        for obj in _rows(row, "attributes", path, f"row {n}"):
            where = f"image {image_id} object {obj.get('object_id')}"
            raw = obj.get("attributes") or []
            if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
                raise ValueError(f"{path}: {where} 'attributes' must be a list of strings; fix the file")
            out[(image_id, _get(obj, "object_id", int, path, where))] = raw
    return out


def _inside(box: list[float], width: int, height: int) -> list[float] | None:
    """VG's x, y, w, h clipped to the `width` x `height` image, or None when no area is left."""
    x, y, w, h = box
    x1, y1 = min(max(x, 0), width), min(max(y, 0), height)
    x2, y2 = min(max(x + w, 0), width), min(max(y + h, 0), height)
    if w <= 0 or h <= 0 or x2 <= x1 or y2 <= y1:
        return None
    return [x1, y1, x2 - x1, y2 - y1]


def convert_visual_genome(
    objects_json: str | Path,
    attributes_json: str | Path,
    image_data_json: str | Path,
    objects_vocab: str | Path,
    attributes_vocab: str | Path,
    out_json: str | Path,
    images_subdir: str = "",
) -> dict[str, int]:
    """Write Visual Genome's objects, attributes and image data as COCO detection JSON with
    `attribute_ids` per annotation and top-level `attributes`; returns counts.

    Names are cleaned as bottom-up-attention does (peteanderson80/bottom-up-attention,
    data/genome/setup_vg.py and lib/datasets/vg.py): lower-cased, stripped, a final period dropped; an
    object is its first name, and a name like "white dog" whose leading words are all common adjectives
    becomes "dog" with those words as attributes; attribute strings split on " and " (except "black and
    white"); any synonym on a vocab line maps to that line. Objects outside the object vocab are skipped,
    attributes outside the attribute vocab dropped, and images left with no object are not written.
    Category and attribute ids are vocab line + 1, so contiguous indices follow the vocab files; boxes
    are VG's x, y, w, h clipped to the image (counted), and a box with no area inside it (a width or
    height of zero or less, or lying wholly outside) is skipped (counted). Two image_data rows for one
    image are refused, naming both.
    """
    objects_json, out_json = Path(objects_json), Path(out_json)
    if out_json.exists() and not out_json.is_file():  # checked first: writing to a FIFO would hang
        raise ValueError(
            f"{out_json} exists and is not a regular file (a FIFO, device or folder); give a new path"
        )
    class_names, class_index = read_vocab(objects_vocab)
    attribute_names, attribute_index = read_vocab(attributes_vocab)
    sizes = _vg_sizes(Path(image_data_json))
    object_attributes = _vg_attributes(Path(attributes_json))
    counts = dict.fromkeys(
        (
            "images",
            "annotations",
            "unknown_object",
            "unknown_attribute",
            "images_without_objects",
            "clipped_box",
            "box_without_area",
        ),
        0,
    )
    images, annotations = [], []
    for n, row in enumerate(_vg_list(objects_json, "objects.json")):
        image_id = _get(row, "image_id", int, objects_json, f"row {n}")
        if image_id not in sizes:
            raise ValueError(
                f"{objects_json}: image {image_id} is not in {image_data_json}; use files of one release"
            )
        kept = []
        for obj in _rows(row, "objects", objects_json, f"row {n}"):
            where = f"image {image_id} object {obj.get('object_id')}"
            object_id = _get(obj, "object_id", int, objects_json, where)
            names = _get(obj, "names", list, objects_json, where)
            name, words = _object_name(names[0]) if names and isinstance(names[0], str) else ("", [])
            if name not in class_index:
                counts["unknown_object"] += 1
                continue
            for raw in object_attributes.get((image_id, object_id), []):
                words += _attribute_names(raw)
            known = [attribute_index[w] + 1 for w in words if w in attribute_index]
            counts["unknown_attribute"] += len(words) - len(known)
            box = [_get(obj, key, (int, float), objects_json, where) for key in ("x", "y", "w", "h")]
            if not all(math.isfinite(v) for v in box):
                raise ValueError(f"{objects_json}: {where} box {box} holds a non-finite number; fix the file")
            inside = _inside(box, *sizes[image_id])
            if inside is None:
                counts["box_without_area"] += 1
                continue
            counts["clipped_box"] += inside != box
            box = inside
            kept.append(
                {
                    "id": len(annotations) + len(kept) + 1,
                    "vg_object_id": object_id,
                    "image_id": image_id,
                    "category_id": class_index[name] + 1,
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": 0,
                    "attribute_ids": list(dict.fromkeys(known)),
                }
            )
        if not kept:
            counts["images_without_objects"] += 1
            continue
        width, height = sizes[image_id]
        file_name = str(PurePosixPath(images_subdir, f"{image_id}.jpg"))
        images.append({"id": image_id, "file_name": file_name, "width": width, "height": height})
        annotations += kept
    counts["images"], counts["annotations"] = len(images), len(annotations)
    out = {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i + 1, "name": name} for i, name in enumerate(class_names)],
        "attributes": [{"id": i + 1, "name": name} for i, name in enumerate(attribute_names)],
    }
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(out, separators=(",", ":"), allow_nan=False) + "\n")
    return counts
