"""The whole network with detectron2's module names (backbone, proposal_generator, roi_heads) and its
forward: normalised images -> each image's proposals and their RoI outputs, or, given ground truth,
detectron2's training losses. Two ways in at test time: one image at a time (`forward`, the reference)
or batched on padded canvases (`forward_batched`, for accelerators); both give each image's outputs
independently of its batch-mates."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from extraction.backbone import CanvasMask, Conv2d, ResNetC4
from extraction.box_coder import BoxCoder
from extraction.config import DetectorConfig, TrainingConfig
from extraction.grid import MAP_STRIDE, GridConfig, GridOutputs
from extraction.roi_heads import Res5ROIHeads
from extraction.rpn import RPN
from extraction.sampling import Matcher

RANDOM_SEED = 0
StageTimer = Callable[[str], contextlib.AbstractContextManager]
NETWORK_STAGES = ("backbone", "rpn", "roi_head")
GRID_STAGES = ("backbone", "res5_grid")  # the grid path: no proposals, res5 once over the whole map
FORWARD_MODES = ("per-image", "batched", "auto")  # auto: batched on accelerators, per-image on CPU
# A batched image sits in the top-left corner of a canvas that depends on its own size alone: the
# detector's (min_size, max_size) in the image's orientation (one canvas for every landscape image, one
# for every portrait one: a call's images share few canvases), else its sides rounded up to this
CANVAS_STEP = 128


def forward_path(mode: str, device: torch.device) -> str:
    """`per-image` or `batched` for a FORWARD_MODES value on `device`; ValueError naming the setting."""
    if mode not in FORWARD_MODES:
        raise ValueError(f"forward must be one of {', '.join(FORWARD_MODES)}; got {mode!r}")
    if mode == "auto":
        # on CPU the RoI head already batches an image's 300 RoIs and the canvas only adds work
        return "per-image" if torch.device(device).type == "cpu" else "batched"
    return mode


def canvas_of(h: int, w: int, sides: tuple[int, int] | None = None) -> tuple[int, int]:
    """The canvas of an (h, w) image: `sides` (short, long) in its orientation when it fits, else its
    own sides rounded up to CANVAS_STEP."""
    if sides is not None:
        canvas = (min(sides), max(sides)) if h <= w else (max(sides), min(sides))
        if h <= canvas[0] and w <= canvas[1]:
            return canvas
    return -(-h // CANVAS_STEP) * CANVAS_STEP, -(-w // CANVAS_STEP) * CANVAS_STEP


def canvas_batches(
    images: list[torch.Tensor], batch_size: int, sides: tuple[int, int] | None = None
) -> list[tuple[tuple[int, int], list[int]]]:
    """(canvas (H, W), indices) of each batch of at most `batch_size` images sharing a canvas (`canvas_of`),
    in order of first appearance."""
    return canvas_groups([tuple(image.shape[-2:]) for image in images], batch_size, sides)


def canvas_groups(
    sizes: list[tuple[int, int]], batch_size: int, sides: tuple[int, int] | None = None
) -> list[tuple[tuple[int, int], list[int]]]:
    """`canvas_batches` of images of these (h, w)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (h, w) in enumerate(sizes):
        groups.setdefault(canvas_of(h, w, sides), []).append(i)
    return [
        (canvas, idx[start : start + batch_size])
        for canvas, idx in groups.items()
        for start in range(0, len(idx), batch_size)
    ]


@dataclass
class ImageOutputs:
    """One image's proposals (network-input pixels) and per-proposal network outputs, all float32."""

    proposals: torch.Tensor  # (R, 4) x1, y1, x2, y2
    objectness: torch.Tensor  # (R,) RPN logits
    features: torch.Tensor  # (R, feature_dim) mean-pooled res5
    cls_logits: torch.Tensor  # (R, C+1), background last
    deltas: torch.Tensor  # (R, 4C) class-specific box deltas relative to the proposals
    attr_logits: torch.Tensor  # (R, A+1), "no attribute" last


@dataclass
class CanvasOutputs:
    """A canvas batch's outputs on fixed shapes: each slot's `post_nms_topk` proposal rows, the first
    `valid` ones its proposals (as `ImageOutputs`), the rest zeros."""

    proposals: torch.Tensor  # (B, R, 4)
    objectness: torch.Tensor  # (B, R)
    valid: torch.Tensor  # (B, R) bool
    features: torch.Tensor  # (B, R, feature_dim)
    cls_logits: torch.Tensor  # (B, R, C+1)
    deltas: torch.Tensor  # (B, R, 4C)
    attr_logits: torch.Tensor  # (B, R, A+1)

    def images(self, n: int) -> list[ImageOutputs]:
        """The first `n` slots as `ImageOutputs` (one host sync: the proposal counts)."""
        counts = self.valid[:n].sum(1).tolist()
        return [
            ImageOutputs(*(getattr(self, f)[slot, :count] for f in ImageOutputs.__dataclass_fields__))
            for slot, count in enumerate(counts)
        ]


def _untimed(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


class VGFasterRCNN(nn.Module):
    """Faster R-CNN ResNet-C4 with the attribute head; `state_dict()` matches detectron2's names."""

    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        self.dtype = cfg.dtype
        self.backbone = ResNetC4(
            cfg.blocks_per_stage, cfg.stem_channels, cfg.res2_channels, cfg.bottleneck_channels
        )
        self.proposal_generator = RPN(
            self.backbone.out_channels,
            cfg.rpn_channels,
            cfg.anchor_sizes,
            cfg.anchor_ratios,
            cfg.pre_nms_topk,
            cfg.post_nms_topk,
            cfg.rpn_nms_thresh,
        )
        res4 = self.backbone.out_channels
        self.roi_heads = Res5ROIHeads(
            res4,
            res4 * 2,
            cfg.bottleneck_channels * 8,
            cfg.res5_blocks,
            cfg.pooler_resolution,
            cfg.res5_dilation,
            cfg.num_classes,
            cfg.num_attributes,
            cfg.attr_embed_dim,
            cfg.attr_hidden_dim,
        )
        self.roi_box_coder = BoxCoder(cfg.bbox_reg_weights)

    @property
    def feature_dim(self) -> int:
        """Width of a region feature (res5's output channels)."""
        return self.roi_heads.out_channels

    def forward(
        self,
        images: list[torch.Tensor],
        stage: StageTimer = _untimed,
        targets: list[dict] | None = None,
        train_cfg: TrainingConfig | None = None,
    ) -> list[ImageOutputs] | dict[str, torch.Tensor]:
        """Normalised images, each (3, h, w) at its own size -> each image's outputs; with `targets`, the
        training losses instead (`training_losses`).

        Images run one at a time: an image's outputs never depend on its batch-mates (a padded batch
        changes the convolutions' rounding, and near-tied proposals then flip), and on CPU a batch buys
        nothing since the RoI head, ~90 % of the work, already batches an image's 300 regions.
        `stage(name)` wraps each of NETWORK_STAGES (the detector times them with it).
        """
        if targets is not None:
            return self.training_losses(images, targets, train_cfg or TrainingConfig())
        out = []
        with self._autocast(images[0].device if images else torch.device("cpu")):
            for image in images:
                with stage("backbone"):
                    features = self.backbone(image[None])
                with stage("rpn"):
                    boxes, objectness = self.proposal_generator(features, tuple(image.shape[-2:]))
                with stage("roi_head"):
                    roi = self.roi_heads(features, boxes)
                out.append(
                    ImageOutputs(boxes, objectness, roi.features, roi.cls_logits, roi.deltas, roi.attr_logits)
                )
        return out

    def forward_batched(
        self,
        images: list[torch.Tensor],
        stage: StageTimer = _untimed,
        batch_size: int = 8,
        canvas_sides: tuple[int, int] | None = None,
    ) -> list[ImageOutputs]:
        """`forward` for accelerators: images sharing a canvas (`canvas_of`; `canvas_sides` = the detector's
        (min_size, max_size)) go through `forward_canvas` `batch_size` at a time.

        Every call has a fixed shape (a batch short of `batch_size` is filled with blank canvases, the RoI
        head's call with blank RoIs) and each image's activations are masked to its own extent, so an
        image's outputs are bit for bit the same alone or in any batch; against `forward` they differ only
        in rounding (other convolution shapes)."""
        out: list[ImageOutputs | None] = [None] * len(images)
        for canvas, idx in canvas_batches(images, batch_size, canvas_sides):
            x = images[idx[0]].new_zeros((batch_size, 3, *canvas))
            sizes = [(0, 0)] * batch_size
            for slot, i in enumerate(idx):
                h, w = images[i].shape[-2:]
                x[slot, :, :h, :w] = images[i]
                sizes[slot] = (h, w)
            for i, image_out in zip(idx, self.forward_canvas(x, sizes, stage).images(len(idx)), strict=True):
                out[i] = image_out
        return out

    def forward_canvas(
        self,
        x: torch.Tensor,
        sizes: list[tuple[int, int]],
        stage: StageTimer = _untimed,
        fixed_shapes: bool | None = None,
    ) -> CanvasOutputs:
        """A canvas batch (B, 3, H, W), normalised and zero beyond each slot's image of (h, w) ((0, 0) for a
        blank slot) -> every slot's proposals and RoI outputs on fixed shapes, without a host sync: the
        trunk, the RPN head, the proposals (`RPN.proposals_batched`) and the RoI head (B x post_nms_topk
        RoIs) run once each for the whole batch. `fixed_shapes` (default: on accelerators) picks the
        proposals' NMS: fixed-step greedy for the batch, or torchvision's per image (faster on a CPU)."""
        rpn = self.proposal_generator
        with self._autocast(x.device):
            with stage("backbone"):
                mask = CanvasMask(sizes, tuple(x.shape[-2:]))
                res4 = self.backbone(x, mask)
            with stage("rpn"):
                logits, deltas = rpn.rpn_head(res4.contiguous())
                extents = mask.on(tuple(res4.shape[-2:]), x.device)
                image_hws = mask.on(tuple(x.shape[-2:]), x.device)
                if fixed_shapes is None:
                    fixed_shapes = x.device.type != "cpu"
                boxes, objectness, valid = rpn.proposals_batched(
                    logits, deltas, extents, image_hws, fixed_shapes
                )
            with stage("roi_head"):
                roi = self.roi_heads.forward_padded(res4, boxes)
        return CanvasOutputs(
            boxes, objectness, valid, roi.features, roi.cls_logits, roi.deltas, roi.attr_logits
        )

    def _canvas_trunk(
        self, images: list[torch.Tensor], idx: list[int], canvas: tuple[int, int], batch_size: int
    ) -> tuple[torch.Tensor, CanvasMask]:
        """res4 of `batch_size` canvas slots (images `idx` first, then blanks) and the slots' mask."""
        x = images[idx[0]].new_zeros((batch_size, 3, *canvas))
        sizes = [(0, 0)] * batch_size
        for slot, i in enumerate(idx):
            h, w = images[i].shape[-2:]
            x[slot, :, :h, :w] = images[i]
            sizes[slot] = (h, w)
        mask = CanvasMask(sizes, canvas)
        return self.backbone(x, mask), mask

    def grid_features(
        self,
        images: list[torch.Tensor],
        grid: GridConfig,
        stage: StageTimer = _untimed,
        batch_size: int | None = None,
        canvas_sides: tuple[int, int] | None = None,
    ) -> list[GridOutputs]:
        """Normalised images -> each image's grid cells: stem -> res4 over the whole image, the RoI head's
        res5 (same weights) over the whole res4 map at the grid's stride, pooled by `grid`, then the box
        predictor on each cell. Images run one at a time, as in `forward`, or with `batch_size` on padded
        canvases, as in `forward_batched`; either way a cell never depends on its batch-mates."""
        out: list[GridOutputs | None] = [None] * len(images)
        with self._autocast(images[0].device if images else torch.device("cpu")):
            if batch_size is None:
                batches = [((0, 0), [i]) for i in range(len(images))]
            else:
                batches = canvas_batches(images, batch_size, canvas_sides)
            for canvas, idx in batches:
                with stage("backbone"):
                    if batch_size is None:
                        res4 = self.backbone(images[idx[0]][None])
                        mask, extents = None, [tuple(res4.shape[-2:])]
                    else:
                        res4, mask = self._canvas_trunk(images, idx, canvas, batch_size)
                        extents = mask.at(tuple(res4.shape[-2:]))
                with stage("res5_grid"):
                    res5 = grid.res5_map(self.roi_heads.res5, res4, mask)
                    for slot, i in enumerate(idx):
                        out[i] = self._grid_cells(res5[slot : slot + 1], extents[slot], grid)
        return out

    def _grid_cells(self, res5: torch.Tensor, res4_hw: tuple[int, int], grid: GridConfig) -> GridOutputs:
        """One image's cells from its (1, D, H, W) res5 map (cropped to the image's own part of a canvas)."""
        step = grid.stride // MAP_STRIDE
        res5 = res5[:, :, : -(-res4_hw[0] // step), : -(-res4_hw[1] // step)]
        cells = grid.pool_map(res5)
        features = cells.flatten(2)[0].t().contiguous()  # (rows * cols, D), row-major
        # as the RoI head does, minus the box deltas: a cell's box is the cell
        with torch.autocast(features.device.type, enabled=False):
            predictor = self.roi_heads.box_predictor
            cls_logits = predictor.cls_score(features)
            attr_logits = predictor.attributes(features, cls_logits.argmax(dim=-1))
        return GridOutputs(features, cls_logits, attr_logits, tuple(res5.shape[-2:]))

    def evaluate_image(self, image: torch.Tensor, boxes: torch.Tensor) -> tuple[ImageOutputs, torch.Tensor]:
        """One image's outputs, and the attribute logits (N, A+1) of the given boxes (N, 4) in input pixels
        with the class predicted for each, as at test time (attribute accuracy on ground-truth boxes)."""
        with self._autocast(image.device):
            features = self.backbone(image[None])
            proposals, objectness = self.proposal_generator(features, tuple(image.shape[-2:]))
            roi = self.roi_heads(features, proposals)
            given = self.roi_heads(features, boxes.float()) if boxes.numel() else None
        out = ImageOutputs(proposals, objectness, roi.features, roi.cls_logits, roi.deltas, roi.attr_logits)
        attrs = given.attr_logits if given is not None else roi.attr_logits[:0]
        return out, attrs

    def training_losses(
        self, images: list[torch.Tensor], targets: list[dict], cfg: TrainingConfig
    ) -> dict[str, torch.Tensor]:
        """detectron2's R-C4 training step on a batch, plus the attribute loss.

        Each target holds `boxes` (N, 4) in input pixels, `classes` (N,) 0..C-1, `attributes` (N, K) ids
        padded with -1, and optionally `seed`: the anchor and RoI samples of that image are then drawn from
        it (so they do not depend on how images are split over workers); otherwise from torch's global RNG.
        Proposals are the RPN's own (train-time top-k, no gradient) with the ground-truth boxes appended.
        Returns loss_rpn_cls, loss_rpn_loc, loss_cls, loss_box_reg, loss_attr.
        """
        if len(images) != len(targets):
            raise ValueError(f"got {len(images)} images but {len(targets)} targets")
        rpn = self.proposal_generator
        anchor_matcher = Matcher(list(cfg.rpn_iou_thresholds), [0, -1, 1], allow_low_quality_matches=True)
        roi_matcher = Matcher([cfg.roi_iou_threshold], [0, 1])
        features, scores, deltas, anchors, labels, matched, sampled = [], [], [], [], [], [], []
        with self._autocast(images[0].device):
            for image, target in zip(images, targets, strict=True):
                generator = None
                if target.get("seed") is not None:
                    generator = torch.Generator().manual_seed(int(target["seed"]))
                gt_boxes = target["boxes"].float()
                f = self.backbone(image[None])
                s, d = rpn.head_outputs(f)
                a = rpn.anchor_generator(*f.shape[-2:])
                lab, m = rpn.label_anchors(
                    a, gt_boxes, anchor_matcher, cfg.rpn_batch_size, cfg.rpn_positive_fraction, generator
                )
                with torch.no_grad():
                    proposals, _ = rpn.proposals(
                        s.detach(),
                        d.detach(),
                        tuple(f.shape[-2:]),
                        tuple(image.shape[-2:]),
                        cfg.rpn_pre_nms_topk,
                        cfg.rpn_post_nms_topk,
                    )
                sampled.append(
                    self.roi_heads.sample_proposals(
                        proposals,
                        gt_boxes,
                        target["classes"].long(),
                        target["attributes"].long(),
                        roi_matcher,
                        cfg.roi_batch_size,
                        cfg.roi_positive_fraction,
                        generator,
                    )
                )
                features.append(f)
                scores.append(s)
                deltas.append(d)
                anchors.append(a)
                labels.append(lab)
                matched.append(m)
            losses = rpn.losses(scores, deltas, anchors, labels, matched, cfg.rpn_batch_size)
            losses.update(self.roi_heads.losses(features, sampled, self.roi_box_coder, cfg.attr_loss_weight))
        return losses

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=getattr(torch, self.dtype))


@torch.no_grad()
def init_random_weights(model: VGFasterRCNN, seed: int = RANDOM_SEED) -> None:
    """Fill every parameter from a fixed-seed CPU generator: the same weights in every process.

    Convolutions get c2_msra (He, fan-out) init and the last conv of each residual branch a small
    FrozenBN scale, so activations stay O(1) through 101 layers; predictors get small normal weights.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            fan_out = module.out_channels * module.kernel_size[0] * module.kernel_size[1]
            std = 0.01 if name.startswith("proposal_generator") else math.sqrt(2.0 / fan_out)
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            if module.bias is not None:
                module.bias.zero_()
            if name.endswith("conv3"):
                module.norm.weight.fill_(0.2)
            if isinstance(module, Conv2d):
                module.fold()
        elif isinstance(module, nn.Linear):
            std = 0.001 if name.endswith("bbox_pred") else 0.01
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
            module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.copy_(torch.randn(module.weight.shape, generator=gen))
