"""`Detector`: images in, `storage.RegionFeatures` out (preprocess, network, selection, rescale)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import platform
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from extraction.box_coder import BoxCoder, clip_boxes
from extraction.config import DetectorConfig, SelectionConfig, resolve_config
from extraction.preprocess import batch_images, load_image, resize_image
from extraction.rcnn import RANDOM_SEED, VGFasterRCNN, init_random_weights
from extraction.selection import select
from extraction.weights import load_detector_weights
from storage import RegionFeatures

log = logging.getLogger(__name__)

STAGES = ("preprocess", "backbone", "rpn", "roi_head", "selection")
RANDOM_WEIGHTS_WARNING = (
    "xmodal detector built with RANDOM weights (seed {seed}): its boxes, labels and features are "
    "meaningless for real use; pass weights=<faster_rcnn_from_caffe_attr.pkl | pytorch_model.bin | "
    ".safetensors>"
)


class Detector:
    """The VG Faster R-CNN R101-C4 feature extractor; build it with `Detector.build`."""

    feature_dim = 2048

    def __init__(
        self,
        model: VGFasterRCNN,
        config: DetectorConfig,
        selection: SelectionConfig,
        preset: str,
        weights: dict,
    ):
        self.model = model
        self.config = config
        self.selection = selection
        self.preset = preset
        self._weights = weights
        self._roi_coder = BoxCoder(config.bbox_reg_weights)

    @classmethod
    def build(
        cls,
        preset: str = "vg-r101-c4",
        weights: str | Path | None = None,
        device: str | torch.device = "cpu",
        selection: str = "caffe",
        min_boxes: int = 36,
        max_boxes: int = 36,
        strict: bool = True,
        **overrides,
    ) -> Detector:
        """A ready detector; `overrides` name fields of DetectorConfig or SelectionConfig."""
        config, sel = resolve_config(preset, selection, min_boxes, max_boxes, **overrides)
        model = VGFasterRCNN(config)
        if weights is None:
            init_random_weights(model, RANDOM_SEED)
            message = RANDOM_WEIGHTS_WARNING.format(seed=RANDOM_SEED)
            warnings.warn(message, stacklevel=2)
            log.warning(message)
            info = {"path": "random", "sha256": None, "seed": RANDOM_SEED}
        else:
            report = load_detector_weights(model, weights, strict=strict)
            info = {"path": str(weights), "sha256": _sha256(Path(weights)), "report": report.summary()}
        model.eval().to(torch.device(device))
        return cls(model, config, sel, preset, info)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def provenance(self) -> dict:
        """What produced the features: preset, configs, weights (path + sha256 or random), versions."""
        import cv2
        import PIL
        import torchvision

        return {
            "detector": "vg-faster-rcnn-r101-c4",
            "preset": self.preset,
            "config": dataclasses.asdict(self.config),
            "weights": self._weights["path"],
            "weights_sha256": self._weights["sha256"],
            "selection": self.selection.rule,
            "selection_config": dataclasses.asdict(self.selection),
            "min_boxes": self.selection.min_boxes,
            "max_boxes": self.selection.max_boxes,
            "feature_dim": self.feature_dim,
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "torchvision": torchvision.__version__,
                "numpy": np.__version__,
                "opencv": cv2.__version__,
                "pillow": PIL.__version__,
            },
        }

    def detect(
        self,
        images: list[np.ndarray | str | Path],
        ids: list[str] | None = None,
        timings: dict[str, float] | None = None,
    ) -> list[RegionFeatures]:
        """Regions of each image (BGR uint8 arrays or paths), run as one batch.

        `timings`, when given, accumulates seconds per stage (STAGES).
        """
        if ids is not None and len(ids) != len(images):
            raise ValueError(f"got {len(images)} images but {len(ids)} ids")
        if not images:
            return []
        if ids is None:
            ids = [Path(im).stem if isinstance(im, (str, Path)) else str(i) for i, im in enumerate(images)]
        cfg = self.config
        stage = _StageTimer(timings, self.device)
        with torch.inference_mode():
            with stage("preprocess"):
                originals = [
                    load_image(im) if isinstance(im, (str, Path)) else load_image(im, ids[i])
                    for i, im in enumerate(images)
                ]
                resized = [resize_image(im, cfg.min_size, cfg.max_size) for im in originals]
                batch, sizes = batch_images(resized, cfg.pixel_mean, cfg.pixel_std, self.device)
            with self._autocast():
                with stage("backbone"):
                    features = self.model.backbone(batch, sizes)
                with stage("rpn"):
                    feature_sizes = self.model.backbone.output_sizes(sizes)
                    proposals = self.model.proposal_generator(features, feature_sizes, sizes)
                with stage("roi_head"):
                    heads = self.model.roi_heads(features, [boxes for boxes, _ in proposals])
            with stage("selection"):
                results = [
                    self._regions(img_id, orig.shape[:2], size, boxes, out)
                    for img_id, orig, size, (boxes, _), out in zip(
                        ids, originals, sizes, proposals, heads, strict=True
                    )
                ]
        return results

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.config.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.config.dtype))

    def _regions(self, img_id, orig_hw, size, proposals, out) -> RegionFeatures:
        num_classes = self.config.num_classes
        probs = F.softmax(out.cls_logits, dim=-1)
        pred_boxes = None
        if self.selection.rule != "caffe":
            pred_boxes = self._roi_coder.decode(out.deltas, proposals).view(-1, num_classes, 4)
            pred_boxes = clip_boxes(pred_boxes, *size)
        chosen = select(proposals, probs, pred_boxes, self.selection)
        # softmax over all A+1 attributes, then the best real one ("no attribute", last, is excluded)
        attrs_conf, attrs_id = F.softmax(out.attr_logits[chosen.index], dim=-1)[:, :-1].max(dim=1)
        orig_h, orig_w = orig_hw
        scale = torch.tensor([orig_w / size[1], orig_h / size[0]] * 2, device=proposals.device)
        boxes = clip_boxes(chosen.boxes * scale, orig_h, orig_w)
        return RegionFeatures(
            img_id=img_id,
            img_h=int(orig_h),
            img_w=int(orig_w),
            boxes=boxes.cpu().numpy().astype(np.float32),
            features=out.features[chosen.index].cpu().numpy().astype(np.float32),
            objects_id=chosen.classes.cpu().numpy().astype(np.int64),
            objects_conf=chosen.scores.cpu().numpy().astype(np.float32),
            attrs_id=attrs_id.cpu().numpy().astype(np.int64),
            attrs_conf=attrs_conf.cpu().numpy().astype(np.float32),
        )


class _StageTimer:
    """Adds each stage's wall time to `timings` (synchronising CUDA so the time is the stage's own)."""

    def __init__(self, timings: dict[str, float] | None, device: torch.device):
        self.timings = timings
        self.sync = device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.timings is None:
            yield
            return
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
