"""A tiny fine-tuned VQA directory (random weights, 2048-d features) for the serve tests and benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipelines.tasks.finetune import FinetuneConfig
from pipelines.tasks.finetuned import build_task
from storage import FeatureWriter, RegionFeatures

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "color", "is", "the", "square", "?"]
ANSWERS = ["red", "green", "blue", "yellow", "square", "circle"]
BOXES = 8
# the extraction the features were made with, as the store records it: the server rebuilds this detector
PROVENANCE = {
    "preset": "vg-r101-c4",
    "selection": "caffe",
    "min_boxes": BOXES,
    "max_boxes": BOXES,
    "config": {"min_size": 96, "max_size": 128, "post_nms_topk": 12},
    "weights": "random",
}


def write_tiny_checkpoint(root: Path) -> Path:
    """`root/best`, as a fine-tuning task's `save` writes it, over a two-image store of random regions."""
    rng = np.random.default_rng(0)
    with FeatureWriter(root / "feats.lmdb", feature_dim=2048, max_boxes=BOXES, meta=PROVENANCE) as writer:
        for i in range(2):
            xy = rng.uniform(0, 40, (BOXES, 2))
            boxes = np.concatenate([xy, xy + rng.uniform(4, 20, (BOXES, 2))], axis=1).astype(np.float32)
            ones = np.ones(BOXES, np.float32)
            ids = np.arange(BOXES, dtype=np.int64)
            feats = rng.random((BOXES, 2048), dtype=np.float32)
            writer.put(RegionFeatures(f"img{i}", 64, 80, boxes, feats, ids, ones, ids, ones))
    rows = [
        {"question_id": i, "img_id": f"img{i % 2}", "sent": "what color is the square?", "label": {a: 1.0}}
        for i, a in enumerate(ANSWERS)
    ]
    (root / "train.json").write_text(json.dumps(rows))
    (root / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    cfg = FinetuneConfig(
        task="vqa",
        features=[str(root / "feats.lmdb")],
        train_files=[str(root / "train.json")],
        preset="tiny",
        vocab=str(root / "vocab.txt"),
    )
    task = build_task(cfg)
    torch.manual_seed(0)
    task.save(task.build_model(), root / "best")
    return root / "best"
