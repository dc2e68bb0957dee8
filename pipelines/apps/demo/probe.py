"""How much the stored region features know: a linear probe from the features of regions lying on a
generated shape (IoU >= 0.5) to that shape's kind, colour, row and column, fit on the training scenes and
scored on the held-out ones (which the demo's detector never trained on)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torchvision.ops import box_iou

from pipelines.apps.demo.synthetic import load_scenes
from storage import FeatureReader

MIN_IOU = 0.5


PROBED = ("shape", "colour", "row", "column")  # what the probe predicts, fields of a generated Shape


def _regions(scenes_json: Path, store: Path) -> dict[bool, tuple[list[np.ndarray], list[tuple[str, ...]]]]:
    """{is training scene: (features, PROBED fields)} of the best-overlapping stored region per shape."""
    out: dict[bool, tuple[list, list]] = {True: ([], []), False: ([], [])}
    reader = FeatureReader(store)
    try:
        for scene in load_scenes(scenes_json):
            if not scene.shapes:
                continue
            rec = reader[scene.img_id]
            # the scenes' boxes are inclusive pixels; the detector's are continuous coordinates
            truth = torch.tensor([[s.box[0], s.box[1], s.box[2] + 1, s.box[3] + 1] for s in scene.shapes])
            iou = box_iou(truth.float(), torch.from_numpy(rec.boxes).float())
            best, index = iou.max(dim=1)
            for shape, quality, i in zip(scene.shapes, best.tolist(), index.tolist(), strict=True):
                if quality >= MIN_IOU:
                    out[scene.split == "train"][0].append(rec.features[i].astype(np.float32))
                    out[scene.split == "train"][1].append(tuple(getattr(shape, f) for f in PROBED))
    finally:
        reader.close()
    return out


def _fit_and_score(train_x, train_y, test_x, test_y, seed: int) -> float:
    labels = sorted(set(train_y))
    xt, xs = torch.from_numpy(np.stack(train_x)), torch.from_numpy(np.stack(test_x))
    yt = torch.tensor([labels.index(y) for y in train_y])
    ys = torch.tensor([labels.index(y) if y in labels else -1 for y in test_y])
    mean, std = xt.mean(0), xt.std(0) + 1e-6
    torch.manual_seed(seed)
    linear = torch.nn.Linear(xt.shape[1], len(labels))
    opt = torch.optim.LBFGS(linear.parameters(), max_iter=200)

    def closure():
        opt.zero_grad()
        logits = linear((xt - mean) / std)
        loss = torch.nn.functional.cross_entropy(logits, yt) + 1e-3 * linear.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return float((linear((xs - mean) / std).argmax(1) == ys).float().mean())


def linear_probe(scenes_json: Path, store: Path, seed: int = 0) -> dict:
    """Held-out accuracy of a logistic-regression probe for each of the shape, colour, row and column, and
    how many regions it was fit and scored on (shapes without a region at IoU >= 0.5 are left out and
    counted)."""
    regions = _regions(scenes_json, store)
    (train_x, train_y), (test_x, test_y) = regions[True], regions[False]
    shapes = sum(len(s.shapes) for s in load_scenes(scenes_json))
    result = {"train_regions": len(train_y), "held_out_regions": len(test_y), "shapes": shapes}
    if not train_y or not test_y:
        return result
    for k, what in enumerate(PROBED):
        result[f"{what}_accuracy"] = _fit_and_score(
            train_x, [y[k] for y in train_y], test_x, [y[k] for y in test_y], seed
        )
    return result
