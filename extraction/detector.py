"""`Detector`: images in, `storage.RegionFeatures` out (load weights, preprocess, run, post-process)."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from extraction.backbone import conv_memory_format, set_memory_format
from extraction.box_coder import BoxCoder
from extraction.config import DEFAULT_PRESET, DetectorConfig
from extraction.grid import GridConfig
from extraction.postprocess import download, padded_records, padded_regions, to_grid_record, to_records
from extraction.precision import deterministic_cudnn, float32_precision
from extraction.preprocess import batch_images, canvas_batch, load_image, resize_image
from extraction.provenance import provenance, weights_record
from extraction.rcnn import (
    GRID_STAGES,
    NETWORK_STAGES,
    RANDOM_SEED,
    VGFasterRCNN,
    canvas_groups,
    forward_path,
    init_random_weights,
)
from extraction.selection import SelectionConfig
from extraction.weights import load_detector_weights, resolve_detector, weights_file
from storage import RegionFeatures

log = logging.getLogger(__name__)

STAGES = ("preprocess", *NETWORK_STAGES, "selection")
FORWARD_BATCH = 8  # images per trunk call of the batched forward (a shorter batch is filled with blanks)
GRID_DETECT_STAGES = ("preprocess", *GRID_STAGES, "selection")  # `detect` with a grid
RANDOM_WEIGHTS_WARNING = (
    "xmodal detector built with RANDOM weights (seed {seed}): its boxes, labels and features are "
    "meaningless for real use; pass weights=<faster_rcnn_from_caffe_attr.pkl | pytorch_model.bin | "
    ".safetensors> or a trained detector directory (xmodal detector train's RUN/best)"
)


class Detector:
    """The VG Faster R-CNN feature extractor; build it with `Detector.build`. With a `grid` it writes the
    grid's cells (res5 over the whole image, pooled) instead of selected regions."""

    def __init__(
        self,
        model: VGFasterRCNN,
        config: DetectorConfig,
        selection: SelectionConfig,
        preset: str,
        weights: dict,
        classes: list[str] | None = None,
        attributes: list[str] | None = None,
        grid: GridConfig | None = None,
        forward: str = "auto",
        forward_batch: int = FORWARD_BATCH,
        fixed_shapes: bool | None = None,
    ):
        forward_path(forward, torch.device("cpu"))  # a bad value fails here, naming the setting
        if forward_batch < 1:
            raise ValueError(f"forward_batch must be at least 1, got {forward_batch}")
        self.model = model
        self.config = config
        self.selection = selection
        self.preset = preset
        self._weights = weights
        self.classes = classes  # object and attribute names where the weights carry them
        self.attributes = attributes
        self.grid = grid
        self.forward = forward  # FORWARD_MODES: which of the network's two ways in `detect` takes
        self.forward_batch = forward_batch
        # the accelerator form of the work between the network's calls: proposals' NMS and the caffe
        # selection on fixed shapes without host syncs; None: on accelerators (a CPU runs torchvision's nms
        # and the per-image selection, the faster there; the records are the same)
        self.fixed_shapes = fixed_shapes
        self._pixel_buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # mean, std on the device
        self._roi_coder = BoxCoder(config.bbox_reg_weights)

    @classmethod
    def build(
        cls,
        preset: str = DEFAULT_PRESET,
        weights: str | Path | None = None,
        device: str | torch.device = "cpu",
        selection: str = "caffe",
        min_boxes: int = 36,
        max_boxes: int = 36,
        strict: bool = True,
        grid: str | GridConfig | None = None,
        forward: str = "auto",
        forward_batch: int = FORWARD_BATCH,
        fixed_shapes: bool | None = None,
        **overrides,
    ) -> Detector:
        """A ready detector; `overrides` name fields of DetectorConfig or SelectionConfig.

        `weights` may be a detector directory (detector.json + model.safetensors): its own architecture
        and class and attribute names are used, and `preset` names only where the settings started.
        `grid` (`14x14`, `native/2` or a GridConfig) makes it a grid-feature extractor; the selection
        settings then only name the attribute softmax convention and whether to keep class_probs.

        `forward`: `per-image` (the reference), `batched` (images of one orientation through the trunk
        together on a masked canvas of the working size, `forward_batch` per call, the RoIs of as many
        images through res5 in one call) or `auto` (batched on accelerators, per-image on CPU). An image's
        record does not depend on its batch-mates either way; the two paths differ in rounding only."""
        forward_path(forward, torch.device("cpu"))  # refused before any weights are read
        if isinstance(grid, str):
            grid = GridConfig.parse(grid)
        config, sel, preset, classes, attributes = resolve_detector(
            preset, weights, selection, min_boxes, max_boxes, **overrides
        )
        model = VGFasterRCNN(config)
        if weights is None:
            init_random_weights(model, RANDOM_SEED)
            message = RANDOM_WEIGHTS_WARNING.format(seed=RANDOM_SEED)
            # A warning, not also a log line: the CLI routes warnings to its log (once per command);
            # a library user sees it once per call site.
            warnings.warn(message, stacklevel=2)
            info = weights_record(None, RANDOM_SEED)
        else:
            report = load_detector_weights(model, weights_file(weights), strict=strict)
            info = weights_record(weights, RANDOM_SEED, report.summary(), classes, attributes)
        device = torch.device(device)
        # folded here on the CPU, in float64 as always (the same weights on every device), then moved
        # in their layout
        set_memory_format(model, conv_memory_format(device, config.dtype))
        model.eval().to(device)
        return cls(
            model,
            config,
            sel,
            preset,
            info,
            classes,
            attributes,
            grid,
            forward,
            forward_batch,
            fixed_shapes,
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def _fixed_shapes(self) -> bool:
        return self.fixed_shapes if self.fixed_shapes is not None else self.device.type != "cpu"

    @property
    def forward_path(self) -> str:
        """`per-image` or `batched`: the path `detect` takes on this detector's device."""
        return forward_path(self.forward, self.device)

    @property
    def feature_dim(self) -> int:
        return self.model.feature_dim

    def provenance(self) -> dict:
        """What produced the features: preset, configs, weights (path + sha256 or random), versions."""
        return provenance(
            self.preset,
            self.config,
            self.selection,
            self._weights,
            self.feature_dim,
            self.grid,
            self.call_shape,
        )

    @property
    def call_shape(self) -> dict:
        """The network's call shape on this device, whatever the number of images `detect` is given: the
        batched forward runs the trunk on `canvases` slots (blank ones fill a short batch) and res5 on
        `roi_rows` RoIs per call; the per-image forward runs each image alone."""
        if self.forward_path == "per-image":
            return {"forward": "per-image"}
        rows = None if self.grid is not None else self.forward_batch * self.config.post_nms_topk
        return {"forward": "batched", "canvases": self.forward_batch, "roi_rows": rows}

    def detect(
        self,
        images: list[np.ndarray | str | Path],
        ids: list[str] | None = None,
        timings: dict[str, float] | None = None,
        original_sizes: list[tuple[int, int]] | None = None,
    ) -> list[RegionFeatures]:
        """Regions (or grid cells) of each image (BGR uint8 arrays or paths); an image's record does not
        depend on the other images of the call.

        `original_sizes`, when given, says the images are already at the working size (`load_resized`)
        and gives the (h, w) of their originals: boxes and sizes then come back in original pixels.
        `timings`, when given, accumulates seconds per stage (STAGES, or GRID_DETECT_STAGES with a grid).
        """
        if ids is not None and len(ids) != len(images):
            raise ValueError(f"got {len(images)} images but {len(ids)} ids")
        if original_sizes is not None and len(original_sizes) != len(images):
            raise ValueError(f"got {len(images)} images but {len(original_sizes)} original sizes")
        if not images:
            return []
        if ids is None:
            ids = [Path(im).stem if isinstance(im, (str, Path)) else str(i) for i, im in enumerate(images)]
        cfg = self.config
        stage = _StageTimer(timings, self.device)
        batch = self.forward_batch if self.forward_path == "batched" else None
        sides = (cfg.min_size, cfg.max_size)  # the batched forward's canvas, in each image's orientation
        # float32 means IEEE float32 on CUDA too: TF32 would move scores enough to swap near-tied regions;
        # cuDNN's deterministic algorithms make two runs write the same bits
        cudnn = deterministic_cudnn() if self.device.type == "cuda" else contextlib.nullcontext()
        with torch.inference_mode(), float32_precision(tf32=False), cudnn:
            with stage("preprocess"):
                loaded = [
                    load_image(im) if isinstance(im, (str, Path)) else load_image(im, ids[i])
                    for i, im in enumerate(images)
                ]
                if original_sizes is None:
                    resized = [resize_image(im, cfg.min_size, cfg.max_size) for im in loaded]
                    original_sizes = [im.shape[:2] for im in loaded]
                else:
                    resized = loaded
            input_hws = [im.shape[:2] for im in resized]
            if batch is not None and self.grid is None:
                return self._detect_batched(resized, ids, original_sizes, stage)
            with stage("preprocess"):
                inputs = [
                    batch_images([im], cfg.pixel_mean, cfg.pixel_std, self.device)[0][0] for im in resized
                ]
            if self.grid is not None:
                cells = self.model.grid_features(inputs, self.grid, stage, batch, sides)
                with stage("selection"):
                    return [
                        to_grid_record(
                            out,
                            img_id,
                            size,
                            hw,
                            self.grid,
                            self.selection.rule,
                            self.selection.class_probs,
                        )
                        for out, img_id, size, hw in zip(cells, ids, original_sizes, input_hws, strict=True)
                    ]
            outputs = self.model(inputs, stage)
            with stage("selection"):
                return to_records(
                    outputs,
                    ids,
                    original_sizes,
                    input_hws,
                    self.selection,
                    self._roi_coder,
                    self.fixed_shapes,
                )

    def _detect_batched(
        self,
        resized: list[np.ndarray],
        ids: list[str],
        original_sizes: list[tuple[int, int]],
        stage: _StageTimer,
    ) -> list[RegionFeatures]:
        """`detect`'s batched forward: `forward_batch` canvases per call, uploaded once per call; with fixed
        shapes (the caffe rule) each call's regions stay on the device, all downloaded in one copy at the
        end: one host sync for the whole list."""
        cfg, batch = self.config, self.forward_batch
        input_hws = [tuple(im.shape[:2]) for im in resized]
        padded = self.selection.rule == "caffe" and self._fixed_shapes
        if self._pixel_buffers is None or self._pixel_buffers[0].device != self.device:
            mean = torch.tensor(cfg.pixel_mean, dtype=torch.float32).view(3, 1, 1)
            std = torch.tensor(cfg.pixel_std, dtype=torch.float32).view(3, 1, 1)
            self._pixel_buffers = (mean.to(self.device), std.to(self.device))
        records: list[RegionFeatures | None] = [None] * len(resized)
        pending = []
        for canvas, idx in canvas_groups(input_hws, batch, (cfg.min_size, cfg.max_size)):
            with stage("preprocess"):
                x = canvas_batch([resized[i] for i in idx], batch, canvas, *self._pixel_buffers)
            sizes = [input_hws[i] for i in idx] + [(0, 0)] * (batch - len(idx))
            out = self.model.forward_canvas(x, sizes, stage, self._fixed_shapes)
            with stage("selection"):
                chunk = ([input_hws[i] for i in idx], [original_sizes[i] for i in idx])
                if padded:
                    pending.append((idx, padded_regions(out, len(idx), *chunk, self.selection)))
                    continue
                got = to_records(
                    out.images(len(idx)),
                    [ids[i] for i in idx],
                    chunk[1],
                    chunk[0],
                    self.selection,
                    self._roi_coder,
                    self.fixed_shapes,
                )
                for i, record in zip(idx, got, strict=True):
                    records[i] = record
        with stage("selection"):
            fields = download([f for _, f in pending])
            for (idx, _), host in zip(pending, fields, strict=True):
                got = padded_records(host, [ids[i] for i in idx], [original_sizes[i] for i in idx])
                for i, record in zip(idx, got, strict=True):
                    records[i] = record
        return records


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
