"""A tiny fine-tuned VQA directory and a tiny captioner (random weights, 2048-d features) for the serve
tests and benchmark."""

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


def _write_store(path: Path) -> None:
    """A two-image store of random regions recording PROVENANCE, the extraction the server rebuilds."""
    if path.exists():
        return
    rng = np.random.default_rng(0)
    with FeatureWriter(path, feature_dim=2048, max_boxes=BOXES, meta=PROVENANCE) as writer:
        for i in range(2):
            xy = rng.uniform(0, 40, (BOXES, 2))
            boxes = np.concatenate([xy, xy + rng.uniform(4, 20, (BOXES, 2))], axis=1).astype(np.float32)
            ones = np.ones(BOXES, np.float32)
            ids = np.arange(BOXES, dtype=np.int64)
            feats = rng.random((BOXES, 2048), dtype=np.float32)
            writer.put(RegionFeatures(f"img{i}", 64, 80, boxes, feats, ids, ones, ids, ones))


def write_tiny_checkpoint(root: Path) -> Path:
    """`root/best`, as the VQA task's `save` writes it, over a two-image store of random regions."""
    _write_store(root / "feats.lmdb")
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


CAPTIONS = [["a", "red", "square", "and", "a", "blue", "circle"], ["a", "grey", "picture"]]


def write_tiny_captioner(root: Path) -> Path:
    """`root/caption`, as the captioning task's `save` writes it: a tiny Up-Down model over the store."""
    _write_store(root / "feats.lmdb")
    images = [
        {
            "filename": f"img{i}.jpg",
            "split": "train",
            "cocoid": i,
            "sentences": [{"tokens": t} for t in CAPTIONS],
        }
        for i in range(2)
    ]
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))
    cfg = FinetuneConfig(
        task="caption",
        arch="updown",
        features=[str(root / "feats.lmdb")],
        train_files=[str(root / "dataset_coco.json")],
        preset="tiny",
        model={"visual_feat_dim": 2048},
        vocab_min_count=1,
    )
    task = build_task(cfg)
    torch.manual_seed(0)
    model = task.build_model()
    with torch.no_grad():  # random weights end captions at once; make `<eos>` unlikely so they have words
        model.output.bias[model.config.eos_token_id] -= 5.0
    task.save(model, root / "caption")
    return root / "caption"
