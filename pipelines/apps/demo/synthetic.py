"""Seeded synthetic scenes (coloured shapes) with captions and VQA questions, for the demo and tests."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from pipelines.data.text import SPECIAL_TOKENS

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 215, 30),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "grey": (128, 128, 128),
    "black": (20, 20, 20),
}
SPLITS: tuple[str, ...] = ("train", "valid", "test")
CAPTION_SOURCE = "synthetic_captions"
QA_SOURCE = "synthetic_vqa"


@dataclass
class SyntheticConfig:
    """What to generate; the same config and seed give byte-identical files."""

    num_images: int = 300
    image_size: int = 128
    seed: int = 0
    max_shapes: int = 2
    noisy_fraction: float = 0.5
    noise_std: float = 12.0
    valid_fraction: float = 0.15
    test_fraction: float = 0.15
    image_format: str = "png"

    def __post_init__(self) -> None:
        if self.num_images < len(SPLITS):
            raise ValueError(f"num_images must be at least {len(SPLITS)} (one per split): {self.num_images}")
        if not 1 <= self.max_shapes <= 4:
            raise ValueError(f"max_shapes must be 1..4 (one shape per grid cell), got {self.max_shapes}")
        if self.image_size < 32:
            raise ValueError(f"image_size must be at least 32 pixels, got {self.image_size}")
        if self.valid_fraction < 0 or self.test_fraction < 0 or self.valid_fraction + self.test_fraction >= 1:
            raise ValueError("valid_fraction and test_fraction must be >= 0 and leave images for training")
        if self.image_format not in ("png", "jpg"):
            raise ValueError(f"image_format must be 'png' or 'jpg', got {self.image_format!r}")


@dataclass
class Shape:
    """One drawn shape: its kind, colour, size word, 2x2 grid cell and pixel box (x1, y1, x2, y2)."""

    shape: str
    colour: str
    size: str
    column: str
    row: str
    box: tuple[int, int, int, int]


@dataclass
class Scene:
    img_id: str
    split: str
    width: int
    height: int
    background: str
    noisy: bool
    shapes: list[Shape] = field(default_factory=list)


@dataclass
class SyntheticDataset:
    """Where the generated files are."""

    root: Path
    images_dir: Path
    scenes: Path
    corpus: Path
    vocab: Path
    pretrain: dict[str, Path]
    vqa: dict[str, Path]
    captions: Path  # Karpathy-style split file (dataset_coco.json layout): FILE:train, FILE:val, FILE:test
    descriptions: Path  # the same layout, one `description` per scene: what the demo's captioner learns
    detection: dict[str, Path]  # COCO detection JSON per split: shapes as categories, colours as attributes
    counts: dict[str, int]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: Shape) -> None:
    x1, y1, x2, y2 = shape.box
    fill = COLOURS[shape.colour]
    if shape.shape == "circle":
        draw.ellipse((x1, y1, x2, y2), fill=fill)
    elif shape.shape == "square":
        draw.rectangle((x1, y1, x2, y2), fill=fill)
    else:
        draw.polygon([((x1 + x2) / 2, y1), (x2, y2), (x1, y2)], fill=fill)


def _sample_scene(rng: np.random.Generator, cfg: SyntheticConfig, img_id: str, split: str) -> Scene:
    size = cfg.image_size
    background = str(rng.choice(list(BACKGROUNDS)))
    scene = Scene(img_id, split, size, size, background, bool(rng.random() < cfg.noisy_fraction))
    n = int(rng.integers(1, cfg.max_shapes + 1))
    cells = rng.permutation(4)[:n]
    cell = size // 2
    for c in cells:
        row, col = divmod(int(c), 2)
        big = bool(rng.random() < 0.5)
        side = int(cell * rng.uniform(0.75, 0.95) if big else cell * rng.uniform(0.45, 0.6))
        x1 = col * cell + int(rng.integers(0, cell - side + 1))
        y1 = row * cell + int(rng.integers(0, cell - side + 1))
        scene.shapes.append(
            Shape(
                shape=str(rng.choice(SHAPES)),
                colour=str(rng.choice(list(COLOURS))),
                size="large" if big else "small",
                column="left" if col == 0 else "right",
                row="top" if row == 0 else "bottom",
                box=(x1, y1, x1 + side - 1, y1 + side - 1),
            )
        )
    return scene


def render(scene: Scene, rng: np.random.Generator, noise_std: float) -> Image.Image:
    """Draw a scene as an RGB image; noisy scenes get Gaussian pixel noise over everything."""
    img = Image.new("RGB", (scene.width, scene.height), BACKGROUNDS[scene.background])
    draw = ImageDraw.Draw(img)
    for shape in scene.shapes:
        _draw_shape(draw, shape)
    if not scene.noisy:
        return img
    pixels = np.asarray(img, dtype=np.float32) + rng.normal(0.0, noise_std, (scene.height, scene.width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).round().astype(np.uint8))


def _describe(shape: Shape) -> str:
    return f"a {shape.size} {shape.colour} {shape.shape}"


def captions(scene: Scene) -> list[str]:
    """Two captions: what is where, and the background."""
    parts = [f"{_describe(s)} at the {s.row} {s.column}" for s in scene.shapes]
    what = " and ".join(parts)
    texture = "noisy" if scene.noisy else "plain"
    return [
        f"{what}.",
        f"{len(scene.shapes)} {'shape' if len(scene.shapes) == 1 else 'shapes'} "
        f"on a {texture} {scene.background} background.",
    ]


NUMBER_WORDS: tuple[str, ...] = ("a", "two", "three", "four")


def description(scene: Scene) -> str:
    """Every shape's colour and kind, as many times as the scene holds it, in the order of COLOURS then
    SHAPES: "two red circles, a green square and a blue triangle."

    One sentence per scene, so a captioner has one thing to learn, not a mixture to average over. Places
    are left out: the captioners do not read the boxes, and the regions' features hardly tell where a shape
    lies (the demo's linear probe)."""
    counts = Counter((s.colour, s.shape) for s in scene.shapes)
    parts = [
        f"{NUMBER_WORDS[n - 1]} {colour} {shape}{'s' if n > 1 else ''}"
        for colour in COLOURS
        for shape in SHAPES
        if (n := counts[(colour, shape)])
    ]
    listed = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    return f"{listed}."


def questions(scene: Scene) -> list[dict]:
    """VQA-style questions answerable from the scene: colour (by shape or by side), shape, side (by shape
    or by colour), count.

    Every answer is a single word, so the majority-answer baseline is the most frequent word overall.
    """
    out: list[dict] = []

    def add(sent: str, answer: str, answer_type: str, kind: str) -> None:
        out.append({"sent": sent, "answer": answer, "answer_type": answer_type, "question_type": kind})

    kinds = [s.shape for s in scene.shapes]
    colours = [s.colour for s in scene.shapes]
    columns = [s.column for s in scene.shapes]
    for s in scene.shapes:
        if kinds.count(s.shape) == 1:
            add(f"what color is the {s.shape}?", s.colour, "other", "what color is the")
            add(f"is the {s.shape} on the left or the right?", s.column, "other", "is the")
        if colours.count(s.colour) == 1:
            add(f"what shape is the {s.colour} object?", s.shape, "other", "what shape is the")
            add(f"is the {s.colour} object on the left or the right?", s.column, "other", "is the")
        if columns.count(s.column) == 1:
            add(
                f"what color is the shape on the {s.column}?",
                s.colour,
                "other",
                "what color is the shape on the",
            )
    add("how many shapes are there?", str(len(scene.shapes)), "number", "how many")
    return out


def _assign_splits(rng: np.random.Generator, cfg: SyntheticConfig) -> list[str]:
    n_valid = max(1, round(cfg.num_images * cfg.valid_fraction))
    n_test = max(1, round(cfg.num_images * cfg.test_fraction))
    splits = ["valid"] * n_valid + ["test"] * n_test
    splits += ["train"] * (cfg.num_images - len(splits))
    return [splits[i] for i in rng.permutation(cfg.num_images)]


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def generate(out_dir: str | Path, cfg: SyntheticConfig | None = None) -> SyntheticDataset:
    """Write images, scenes.json, corpus.txt, vocab.txt, the pre-training, VQA and COCO detection JSON
    splits, and the captions and the descriptions as Karpathy split files."""
    cfg = cfg or SyntheticConfig()
    root = Path(out_dir)
    images_dir = root / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(cfg.seed)
    splits = _assign_splits(rng, cfg)

    scenes: list[Scene] = []
    pretrain: dict[str, list[dict]] = {s: [] for s in SPLITS}
    vqa: dict[str, list[dict]] = {s: [] for s in SPLITS}
    corpus: list[str] = []
    karpathy: list[dict] = []
    described: list[dict] = []
    for i, split in enumerate(splits):
        scene = _sample_scene(rng, cfg, f"synth_{i:06d}", split)
        image = render(scene, rng, cfg.noise_std)
        image.save(images_dir / f"{scene.img_id}.{cfg.image_format}")
        scenes.append(scene)

        caps = captions(scene)
        qs = questions(scene)
        karpathy.append(_karpathy_row(i, scene, caps, cfg.image_format))
        described.append(_karpathy_row(i, scene, [description(scene)], cfg.image_format))
        pretrain[split].append(
            {
                "img_id": scene.img_id,
                "sentf": {CAPTION_SOURCE: caps, QA_SOURCE: [q["sent"] for q in qs]},
                "labelf": {QA_SOURCE: [{q["answer"]: 1.0} for q in qs]},
            }
        )
        for j, q in enumerate(qs):
            vqa[split].append(
                {
                    "question_id": i * 100 + j,
                    "img_id": scene.img_id,
                    "sent": q["sent"],
                    "label": {q["answer"]: 1.0},
                    "answer_type": q["answer_type"],
                    "question_type": q["question_type"],
                }
            )
        if split == "train":
            corpus.extend(caps + [q["sent"] for q in qs])

    _write_json(root / "scenes.json", [asdict(s) for s in scenes])
    _write_json(root / "captions.json", {"dataset": "synthetic", "images": karpathy})
    _write_json(root / "descriptions.json", {"dataset": "synthetic", "images": described})
    (root / "corpus.txt").write_text("\n".join(corpus) + "\n")
    write_vocab(corpus, root / "vocab.txt")
    pretrain_paths = {s: root / f"pretrain_{s}.json" for s in ("train", "valid")}
    vqa_paths = {s: root / f"vqa_{s}.json" for s in SPLITS}
    for s, path in pretrain_paths.items():
        _write_json(path, pretrain[s])
    for s, path in vqa_paths.items():
        _write_json(path, vqa[s])
    detection_paths = {s: root / f"detection_{s}.json" for s in SPLITS}
    for s, path in detection_paths.items():
        _write_json(path, detection_json(scenes, s, cfg.image_format))
    counts = {f"images_{s}": splits.count(s) for s in SPLITS}
    counts.update({f"questions_{s}": len(vqa[s]) for s in SPLITS})
    return SyntheticDataset(
        root=root,
        images_dir=images_dir,
        scenes=root / "scenes.json",
        corpus=root / "corpus.txt",
        vocab=root / "vocab.txt",
        pretrain=pretrain_paths,
        vqa=vqa_paths,
        captions=root / "captions.json",
        descriptions=root / "descriptions.json",
        detection=detection_paths,
        counts=counts,
    )


def _karpathy_row(index: int, scene: Scene, caps: list[str], image_format: str) -> dict:
    """One image of a `dataset_coco.json`-style split file; `valid` is Karpathy's `val`."""
    sentences = [
        {"tokens": re.findall(r"\w+", c.lower()), "raw": c, "imgid": index, "sentid": 10 * index + k}
        for k, c in enumerate(caps)
    ]
    return {
        "filepath": "images",
        "filename": f"{scene.img_id}.{image_format}",
        "imgid": index,
        "split": "val" if scene.split == "valid" else scene.split,
        "sentids": [s["sentid"] for s in sentences],
        "sentences": sentences,
        "cocoid": index,
    }


def detection_json(scenes: list[Scene], split: str, image_format: str) -> dict:
    """The scenes of `split` as COCO detection JSON (file names relative to the images folder).

    Image id = the scene's index in `scenes`; one box per shape, tight around its drawn pixels (`Shape.box`
    holds inclusive pixel corners, so width = x2 - x1 + 1); category = the shape, its one attribute the
    colour. Category and attribute ids are 1-based positions in SHAPES and COLOURS.
    """
    category_ids = {name: i + 1 for i, name in enumerate(SHAPES)}
    attribute_ids = {name: i + 1 for i, name in enumerate(COLOURS)}
    images, annotations = [], []
    for index, scene in enumerate(scenes):
        if scene.split != split:
            continue
        images.append(
            {
                "id": index,
                "file_name": f"{scene.img_id}.{image_format}",
                "width": scene.width,
                "height": scene.height,
            }
        )
        for k, shape in enumerate(scene.shapes):
            x1, y1, x2, y2 = shape.box
            w, h = x2 - x1 + 1, y2 - y1 + 1
            annotations.append(
                {
                    "id": 10 * index + k + 1,
                    "image_id": index,
                    "bbox": [x1, y1, w, h],
                    "area": w * h,
                    "category_id": category_ids[shape.shape],
                    "iscrowd": 0,
                    "attribute_ids": [attribute_ids[shape.colour]],
                }
            )
    return {
        "images": images,
        "annotations": annotations,
        "categories": [{"id": i, "name": name} for name, i in category_ids.items()],
        "attributes": [{"id": i, "name": name} for name, i in attribute_ids.items()],
    }


def write_vocab(sentences: list[str], path: Path) -> Path:
    """A whole-word BERT vocab of `sentences` (BERT's special tokens first, then the words sorted).

    The generated language is a closed template set, so every word gets its own token; unlike a trained
    WordPiece vocab the file depends on nothing but the sentences, which keeps seeded runs identical.
    """
    words = sorted({w for s in sentences for w in re.findall(r"\w+|[^\w\s]", s.lower())})
    path.write_text("\n".join([*SPECIAL_TOKENS, *words]) + "\n")
    return path


def load_scenes(path: str | Path) -> list[Scene]:
    """Read scenes.json back into Scene objects."""
    rows = json.loads(Path(path).read_text())
    return [
        Scene(**{**r, "shapes": [Shape(**{**s, "box": tuple(s["box"])}) for s in r["shapes"]]}) for r in rows
    ]
