"""Generated pre-training data: a small LMDB store whose features encode each object's shape and colour,
captions and QA answers that name them, and a vocab built with `xmodal vocab build`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipelines.cli import main as xmodal
from storage import FeatureWriter, RegionFeatures

SHAPES = ("circle", "square", "triangle", "star", "heart", "cross")
COLOURS = ("red", "green", "blue", "yellow", "purple")
FEATURE_DIM = 32


@dataclass
class PretrainData:
    features: Path
    train: Path
    valid: Path
    vocab: Path
    ids: list[str]


def _record(img_id: str, rng: np.random.Generator, shape_protos, colour_protos, boxes: int) -> RegionFeatures:
    n = int(rng.integers(boxes - 2, boxes + 1))  # variable box counts exercise padding
    shapes = rng.integers(len(SHAPES), size=n)
    colours = rng.integers(len(COLOURS), size=n)
    feats = shape_protos[shapes] + colour_protos[colours] + 0.05 * rng.normal(size=(n, FEATURE_DIM))
    xy = rng.uniform(0, 80, size=(n, 2))
    wh = rng.uniform(10, 40, size=(n, 2))
    return RegionFeatures(
        img_id=img_id,
        img_h=120,
        img_w=160,
        boxes=np.concatenate([xy, xy + wh], axis=1).astype(np.float32),
        features=np.maximum(feats, 0).astype(np.float32),
        objects_id=shapes.astype(np.int64),
        objects_conf=rng.uniform(0.5, 1.0, size=n).astype(np.float32),
        attrs_id=colours.astype(np.int64),
        attrs_conf=rng.uniform(0.5, 1.0, size=n).astype(np.float32),
    )


def _rows(records: list[RegionFeatures], rng: np.random.Generator) -> list[dict]:
    rows = []
    for rec in records:
        names = [(COLOURS[c], SHAPES[s]) for s, c in zip(rec.objects_id, rec.attrs_id, strict=True)]
        caps = [f"a {c} {s} next to a {c2} {s2}" for (c, s), (c2, s2) in zip(names, names[1:], strict=False)]
        caps = caps[:2]
        questions = [f"what color is the {s}?" for _, s in names[:2]]
        answers = [{c: 1.0} for c, _ in names[:2]]
        if rng.random() < 0.5:  # a soft label with two answers
            answers[0] = {names[0][0]: 0.9, "the " + COLOURS[(COLOURS.index(names[0][0]) + 1) % 5]: 0.3}
        rows.append(
            {
                "img_id": rec.img_id,
                "sentf": {"mscoco": caps, "vqa": questions},
                "labelf": {"vqa": answers},
            }
        )
    return rows


def make_pretrain_data(root: Path, images: int = 48, valid_images: int = 8, boxes: int = 6, seed: int = 0):
    """Write the store, train/valid JSON and a vocab under `root`."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    shape_protos = rng.uniform(0, 1, size=(len(SHAPES), FEATURE_DIM)) * (
        rng.random((len(SHAPES), FEATURE_DIM)) < 0.4
    )
    colour_protos = rng.uniform(0, 1, size=(len(COLOURS), FEATURE_DIM)) * (
        rng.random((len(COLOURS), FEATURE_DIM)) < 0.4
    )
    ids = [f"img{i:04d}" for i in range(images + valid_images)]
    records = [_record(i, rng, shape_protos, colour_protos, boxes) for i in ids]
    store = root / "feats.lmdb"
    with FeatureWriter(store, feature_dim=FEATURE_DIM, max_boxes=boxes, dtype="float32") as w:
        for rec in records:
            w.put(rec)
    rows = _rows(records, rng)
    train, valid = root / "train.json", root / "valid.json"
    train.write_text(json.dumps(rows[:images]))
    valid.write_text(json.dumps(rows[images:]))
    vocab = root / "vocab.txt"
    assert xmodal(["vocab", "build", str(train), str(valid), "--out", str(vocab), "--vocab-size", "200"]) == 0
    return PretrainData(store, train, valid, vocab, ids)


def tiny_run_overrides() -> list[str]:
    """Tiny model and short schedule for CPU tests."""
    return [
        "task.preset=tiny",
        "task.model={num_object_labels: 8, num_attr_labels: 6}",
        "train.loader_workers=0",
        "train.log_every=1",
        "train.warmup_ratio=0.1",
    ]
