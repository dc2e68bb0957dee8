"""The detector's training task: COCO-style boxes with attributes in, detectron2's R-C4 recipe on the
training engine, COCO box AP and attribute accuracy out; runs save as detector directories."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from extraction.config import (
    DEFAULT_PRESET,
    PRESETS,
    SMALL_PRESET,
    DetectorConfig,
    TrainingConfig,
    resolve_config,
    training_config,
)
from extraction.postprocess import detections
from extraction.rcnn import RANDOM_SEED, VGFasterRCNN, init_random_weights
from extraction.weights import init_from_checkpoint, save_detector_dir
from pipelines.data.detection import DetectionCollate, DetectionData, DetectionDataset, load_detection_json
from pipelines.engine import config_io
from pipelines.engine.launch import fit
from pipelines.engine.trainer import TrainConfig
from pipelines.jobs.ray_runtime import ray_for_workers
from pipelines.scoring.box_ap import attribute_accuracy, box_ap

log = logging.getLogger(__name__)

PRIMARY_METRIC = "AP"


@dataclass
class DetectorTaskConfig:
    """What the detector trains on and from where; `detector` overrides DetectorConfig's test-time
    settings (validation runs with them), `training` overrides the preset's TrainingConfig."""

    RANGES: ClassVar[dict[str, str]] = {
        "score_thresh": "[0, 1]",
        "nms_thresh": "[0, 1]",
        "detections_per_image": "[1, 100000]",
    }

    images: str = ""  # the folder the annotations' file_name values are relative to
    annotations: str = ""  # COCO detection JSON (+ attribute_ids and an attributes table)
    valid: str | None = None  # held-out annotations in the same format: AP picks best/
    valid_images: str | None = None  # default: images
    preset: str = DEFAULT_PRESET
    init: str | None = None  # released VG weights, a backbone-only checkpoint or a detector dir; None: random
    strict: bool = False  # bad boxes, unknown categories and attributes stop the run instead of being counted
    detector: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    score_thresh: float = 0.05  # detectron2's test-time detection settings, for AP
    nms_thresh: float = 0.5
    detections_per_image: int = 100

    def __post_init__(self) -> None:
        # the free-form overrides are checked when the run's config is resolved, before any file is read
        config_io.check_mapping_field((DetectorConfig,), self.detector, "task.detector")
        config_io.check_mapping_field((TrainingConfig,), self.training, "task.training")


def default_train_config(preset: str) -> TrainConfig:
    """detectron2's schedule for the release's network: SGD momentum 0.9, weight decay 1e-4, lr 0.02 at 16
    images per batch, linear warm-up from 1/1000 over 1000 iterations, x0.1 at 60k and 80k of 90k.

    The small preset trains from random weights in minutes on 2 CPU cores: AdamW at 2e-3 (SGD at 0.02
    reached box AP50 0.28 in 600 steps where AdamW reached 0.74), 4 images per step, 900 steps, the same
    warm-up and x0.1 steps at 720 and 850."""
    common = dict(
        weight_decay=1e-4,
        schedule="steps",
        lr_gamma=0.1,
        warmup_factor=0.001,
        clip_norm=None,
        trackers=[],
    )
    if preset == SMALL_PRESET:
        return TrainConfig(
            optimizer="adamw",
            lr=2e-3,
            batch_size=4,
            max_steps=900,
            lr_steps=[720, 850],
            warmup_iters=50,
            eval_every=450,
            log_every=30,
            loader_workers=1,
            **common,
        )
    return TrainConfig(
        optimizer="sgd",
        momentum=0.9,
        lr=0.02,
        batch_size=16,
        max_steps=90000,
        lr_steps=[60000, 80000],
        warmup_iters=1000,
        **common,
    )


@dataclass
class DetectorTrainRun:
    """The whole run as written to config.yaml: `train.*` and `task.*` keys."""

    train: TrainConfig = field(default_factory=lambda: default_train_config(DEFAULT_PRESET))
    task: DetectorTaskConfig = field(default_factory=DetectorTaskConfig)


class DetectionTask:
    """The Task the engine trains (see pipelines.engine.trainer.Task)."""

    primary_metric = PRIMARY_METRIC

    def __init__(self, cfg: DetectorTaskConfig, seed: int = 0):
        if cfg.preset not in PRESETS:
            raise ValueError(f"unknown detector preset {cfg.preset!r}; choose one of {sorted(PRESETS)}")
        self.config = cfg
        self.seed = seed
        self.train_data: DetectionData = load_detection_json(cfg.annotations, cfg.images, strict=cfg.strict)
        if not any(len(image.boxes) for image in self.train_data.images):
            skipped = ", ".join(f"{k} {v}" for k, v in self.train_data.counts.items() if v) or "none given"
            raise ValueError(
                f"{cfg.annotations}: no image has a usable box (skipped: {skipped}); nothing to train on"
            )
        self.valid_data: DetectionData | None = None
        if cfg.valid:
            self.valid_data = load_detection_json(
                cfg.valid, cfg.valid_images or cfg.images, strict=cfg.strict
            )
            for what in ("classes", "attributes"):
                if getattr(self.valid_data, what) != getattr(self.train_data, what):
                    raise ValueError(
                        f"{cfg.valid}: its {what} differ from {cfg.annotations}'s; both files need the same "
                        "categories and attributes tables"
                    )
        self.classes, self.attributes = self.train_data.classes, self.train_data.attributes
        overrides = {**cfg.detector, "num_classes": len(self.classes), "num_attributes": len(self.attributes)}
        self.detector_config: DetectorConfig = resolve_config(cfg.preset, base=None, **overrides)[0]
        self.training: TrainingConfig = training_config(cfg.preset, **cfg.training)
        self.epoch = 0
        report_counts(cfg.annotations, self.train_data)
        if self.valid_data is not None and Path(cfg.valid).resolve() != Path(cfg.annotations).resolve():
            report_counts(cfg.valid, self.valid_data)

    # ---- the Task protocol
    def build_model(self) -> torch.nn.Module:
        model = VGFasterRCNN(self.detector_config)
        init_random_weights(model, RANDOM_SEED)
        if self.config.init:
            init_from_checkpoint(model, self.config.init, self.classes, self.attributes)
        else:
            log.warning(
                "training the detector from random weights (no --init): fine for small data such as the "
                "demo's; for real images start from released or backbone weights"
            )
        model.backbone.freeze(self.training.freeze_at)
        return model

    def train_dataset(self) -> _Split:
        return _Split(DetectionDataset(self.train_data), train=True)

    def valid_dataset(self) -> _Split | None:
        return _Split(DetectionDataset(self.valid_data), train=False) if self.valid_data is not None else None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def collate(self, items: list, rng: np.random.Generator) -> dict:
        """Each image draws its scale, flip and samples from (seed, epoch, its index): the same whatever the
        batch it lands in, so N workers see what one worker sees."""
        train = bool(items[0]["train"])
        cfg, det = self.training, self.detector_config
        collate = DetectionCollate(
            cfg.min_sizes if train else (det.min_size,),
            cfg.max_size if train else det.max_size,
            cfg.flip_prob if train else 0.0,
            det.pixel_mean,
            det.pixel_std,
            train=train,
        )
        parts = []
        for item in items:
            key = [self.seed, self.epoch, int(item["index"])]
            part = collate([item], np.random.default_rng(key))
            if train:
                part["targets"][0]["seed"] = int(np.random.SeedSequence(key).generate_state(1)[0])
            parts.append(part)
        return _merge(parts)

    def loss(self, model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        losses = model(batch["images"], targets=batch["targets"], train_cfg=self.training)
        total = sum(losses.values())
        return total, {k: v.detach() for k, v in losses.items()}

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, loader) -> dict[str, float]:
        data = self.valid_data
        if data is None:
            return {}
        metrics = evaluate_detector(model, loader, data, self.config)
        # an area range without ground-truth boxes has no AP (NaN): left out of the run's log
        return {k: v for k, v in metrics.items() if not math.isnan(v)}

    def save(self, model: torch.nn.Module, directory: Path) -> None:
        save_detector_dir(
            model, self.detector_config, self.config.preset, self.classes, self.attributes, directory
        )


def evaluate_detector(model: VGFasterRCNN, batches, data: DetectionData, cfg: DetectorTaskConfig) -> dict:
    """COCO box AP (pycocotools) of the model's detections over `batches` of `data`'s images, and the
    accuracy of the attribute predicted on each ground-truth box (given its predicted class)."""
    results, predicted, gold = [], [], []
    coder = model.roi_box_coder
    for batch in batches:
        for i, image in enumerate(batch["images"]):
            out, gt_attr_logits = model.evaluate_image(image, batch["targets"][i]["boxes"])
            hw = tuple(image.shape[-2:])
            found = detections(out, hw, coder, cfg.score_thresh, cfg.nms_thresh, cfg.detections_per_image)
            sx, sy = (float(v) for v in batch["scale"][i])
            oh, ow = (int(v) for v in batch["orig_hw"][i])
            boxes = found.boxes.cpu().double() / torch.tensor([sx, sy, sx, sy], dtype=torch.float64)
            boxes[:, 0::2] = boxes[:, 0::2].clamp(0, ow)
            boxes[:, 1::2] = boxes[:, 1::2].clamp(0, oh)
            image_id = int(batch["image_ids"][i])
            for box, score, cls in zip(
                boxes.tolist(), found.scores.tolist(), found.classes.tolist(), strict=True
            ):
                x1, y1, x2, y2 = box
                results.append(
                    {
                        "image_id": image_id,
                        "category_id": int(cls) + 1,
                        "bbox": [x1, y1, x2 - x1, y2 - y1],
                        "score": float(score),
                    }
                )
            if gt_attr_logits.numel():
                predicted.append(gt_attr_logits[:, :-1].argmax(dim=1).cpu().numpy())
                gold.extend(list(batch["targets"][i]["attributes"].cpu().numpy()))
    metrics = box_ap(data.to_coco_gt(), results)
    if data.attributes:
        preds = np.concatenate(predicted) if predicted else np.zeros(0, dtype=np.int64)
        metrics["attr_acc"] = attribute_accuracy(preds, [g[g >= 0] for g in gold])
    return metrics


class _Split(torch.utils.data.Dataset):
    """A dataset whose items say whether they are for training (augmented) or evaluation."""

    def __init__(self, dataset: DetectionDataset, train: bool):
        self.dataset, self.train = dataset, train

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return {**self.dataset[i], "train": self.train}


def _merge(parts: list[dict]) -> dict:
    merged: dict = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if isinstance(values[0], torch.Tensor):
            merged[key] = torch.cat(values)
        else:
            merged[key] = [v for value in values for v in value]
    return merged


def report_counts(path: str | Path, data: DetectionData) -> None:
    """One warning per annotation file: the bad annotations skipped or fixed, and the flag that stops."""
    fixed = {k: v for k, v in data.counts.items() if v}
    if fixed:
        log.warning(
            "%s: %s (pass --strict to stop on them instead)",
            path,
            ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in fixed.items()),
        )


def train_detector(run: DetectorTrainRun, out_dir: str | Path, resume: bool = False) -> dict:
    """Train into `out_dir`: checkpoints/, last/ and best/ (by validation AP) are detector directories
    that `xmodal extract --weights` loads."""
    task = DetectionTask(run.task, seed=run.train.seed)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    with ray_for_workers(run.train.workers, run.train.ray_address):
        return fit(task, run.train, out_dir, resume=resume)


def default_run(preset: str) -> DetectorTrainRun:
    return DetectorTrainRun(
        train=default_train_config(preset), task=dataclasses.replace(DetectorTaskConfig(), preset=preset)
    )
