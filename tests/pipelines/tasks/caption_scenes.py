"""A generated captioning corpus: a feature store of two-object scenes and its Karpathy-style split JSON."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from storage import FeatureWriter, RegionFeatures

COLOURS = ("red", "green", "blue")
SHAPES = ("cube", "ball", "cone")
DIM = 16


def write_caption_corpus(root: Path, images: int = 72, valid: int = 12, seed: int = 0) -> tuple[Path, Path]:
    """(store, dataset_coco.json): two coloured shapes per image plus 0-2 distractor regions; two
    references each, the left object named first."""
    rng = np.random.default_rng(seed)
    store, split_file = root / "captions.lmdb", root / "dataset_coco.json"
    rows = []
    with FeatureWriter(store, feature_dim=DIM, max_boxes=4, dtype="float32") as writer:
        for i in range(images):
            n = 2 + int(rng.integers(3))
            feats = rng.normal(0.0, 0.3, (n, DIM)).astype(np.float32)
            x = rng.uniform(0, 80, n)
            boxes = np.stack([x, np.full(n, 10.0), x + 15, np.full(n, 40.0)], 1).astype(np.float32)
            objects = []
            for r in range(2):
                colour, shape = int(rng.integers(3)), int(rng.integers(3))
                feats[r, colour] += 2.0
                feats[r, 3 + shape] += 2.0
                feats[r, 6] = x[r] / 80
                objects.append((x[r], COLOURS[colour], SHAPES[shape]))
            (_, c1, s1), (_, c2, s2) = sorted(objects)
            ones = np.ones(n, np.float32)
            img_id = f"COCO_synth_{i:012d}"
            writer.put(
                RegionFeatures(
                    img_id, 60, 100, boxes, feats, np.zeros(n, np.int64), ones, np.zeros(n, np.int64), ones
                )
            )
            sentences = [f"A {c1} {s1} left of a {c2} {s2}.", f"a {c1} {s1} and a {c2} {s2}"]
            rows.append(
                {
                    "filepath": "synth",
                    "filename": f"{img_id}.jpg",
                    "imgid": i,
                    "split": "val" if i >= images - valid else ("restval" if i % 5 == 0 else "train"),
                    "sentids": [2 * i, 2 * i + 1],
                    "sentences": [
                        {"tokens": s.lower().rstrip(".").split(), "raw": s, "imgid": i, "sentid": 2 * i + k}
                        for k, s in enumerate(sentences)
                    ],
                    "cocoid": 1000 + i,
                }
            )
    split_file.write_text(json.dumps({"images": rows, "dataset": "coco"}))
    return store, split_file
