"""Evaluate trained detector weights on held-out annotations: COCO box AP and attribute accuracy."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from extraction.detector import Detector
from extraction.precision import float32_precision
from pipelines.data.detection import DetectionCollate, DetectionDataset, load_detection_json
from pipelines.engine.devices import DEFAULT_DEVICE, pick_device
from pipelines.tasks.detection import DetectorTaskConfig, evaluate_detector, report_counts

log = logging.getLogger(__name__)


def evaluate_weights(
    weights: str | Path,
    images: str | Path,
    annotations: str | Path,
    preset: str | None = None,
    strict: bool = False,
    device: str = DEFAULT_DEVICE,
) -> dict[str, float]:
    """AP, AP50, AP75, APs, APm, APl (pycocotools) and attr_acc of `weights` on `annotations`, at the
    detector's own test size. The weights' class list must be the annotations' (by name where known)."""
    if not Path(weights).exists():
        raise FileNotFoundError(f"detector weights {str(weights)!r} do not exist")
    data = load_detection_json(annotations, images, strict=strict)
    report_counts(annotations, data)
    device = pick_device(device)
    kwargs = {"preset": preset} if preset else {}
    if not Path(weights).is_dir():
        kwargs |= {"num_classes": len(data.classes), "num_attributes": len(data.attributes)}
    detector = Detector.build(weights=weights, device=device, **kwargs)
    if detector.classes is not None and detector.classes != data.classes:
        raise ValueError(
            f"{annotations}: its categories {data.classes[:5]}... are not the classes {weights} was trained "
            f"on {detector.classes[:5]}...; evaluate on annotations with the same categories table"
        )
    cfg = detector.config
    collate = DetectionCollate((cfg.min_size,), cfg.max_size, 0.0, cfg.pixel_mean, cfg.pixel_std, train=False)
    dataset = DetectionDataset(data)

    def batches():
        for i in range(len(dataset)):
            batch = collate([dataset[i]])
            batch["images"] = [im.to(detector.device) for im in batch["images"]]
            batch["targets"] = [{k: v.to(detector.device) for k, v in t.items()} for t in batch["targets"]]
            yield batch

    with torch.inference_mode(), float32_precision(tf32=False):  # as extraction runs the weights
        metrics = evaluate_detector(detector.model, batches(), data, DetectorTaskConfig())
    return {k: float(v) for k, v in metrics.items()} | {"images": len(dataset)}
