"""Detector training step: seconds per iteration (forward + backward + SGD step) and peak memory, on
synthetic images and boxes with random weights, against torchvision's Faster R-CNN training code.

    python tests/benchmarks/bench_detector_train.py                # c4-small, then vg-r101-c4 vs torchvision
    python tests/benchmarks/bench_detector_train.py --rois 512     # r101 with the preset's whole RoI batch
    python tests/benchmarks/bench_detector_train.py --quick        # r101 at 300x500 with 128 RoIs
    python tests/benchmarks/bench_detector_train.py --device cuda  # 512 RoIs, 2 warm-up + 5 timed steps

Cases: `small` = the c4-small preset at its training sizes (batch of 4 224x224 images, its
TrainingConfig: 2000/300 RPN top-k, 128 RoIs), xmodal only; `r101` = vg-r101-c4 (1600 classes, 400
attributes, freeze_at 2) on one 600x1000 image with detectron2's R-C4 training settings (12000/2000 RPN
top-k, 256 anchors, RoIs at 25 % foreground), xmodal and torchvision (`reference`): FasterRCNN with
its RegionProposalNetwork and RoIHeads around torchvision's resnet101 (frozen BN, layer4 dilated so it
runs at 14x14 like xmodal's res5), RoIPool 14x14 and FastRCNNPredictor(2048, 1601); the table lists what
still differs. Both sides: SGD momentum 0.9, weight decay 1e-4, --lr; five boxes per image.

On CPU r101 defaults to 256 RoIs per image (the preset samples 512) so that a default run takes ~5 minutes
on 2 busy cores: its time is mostly res5 on the RoIs (~0.2-0.3 s per RoI a side there) and its peak grows
~16 MB per RoI, so --rois 512 nearly doubles the r101 time and needs ~8 GB a side.
Warm-up steps sample --warmup-rois RoIs (the same code and backbone shapes, a fraction of the time).

Each side runs in its own process, one after the other (so each peak is its own; VmHWM is reset once the
model and data are built): s/iter is the median of --iters steps after --warmup steps; peak growth is the
largest resident set (CPU, /proc VmHWM) or CUDA allocation (max_memory_allocated) above what the built
model and data held; `best` is the fastest timed step (the least disturbed on a shared machine).
`ratio` = torchvision s/iter / xmodal s/iter on r101 (>1: xmodal faster). The machine is shared: the load
average is printed before and after each side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torchvision.models import resnet101
from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
from torchvision.models.detection.rpn import AnchorGenerator, RPNHead
from torchvision.models.resnet import Bottleneck
from torchvision.ops import MultiScaleRoIAlign, roi_pool
from torchvision.ops.misc import Conv2dNormActivation, FrozenBatchNorm2d

from extraction.config import DEFAULT_PRESET, PRESETS, SMALL_PRESET, TrainingConfig, training_config
from extraction.rcnn import VGFasterRCNN, init_random_weights

BOXES_PER_IMAGE, ATTRIBUTES_PER_BOX = 5, 3
MOMENTUM, WEIGHT_DECAY = 0.9, 1e-4  # detectron2's solver (pipelines.tasks.detection)
CASES = {"small": SMALL_PRESET, "r101": DEFAULT_PRESET}
SIDES = {"small": ("xmodal",), "r101": ("xmodal", "reference")}
DIFFERENCES = (
    "torchvision side: no attribute head (xmodal: class embedding + 2 FC, loss on the foreground RoIs)",
    "torchvision side: stride on the 3x3 conv of res3/res4 (xmodal: on the 1x1, caffe), stem max-pool "
    "padding 1 (xmodal: ceil mode); the same 38x63 res4 grid at 600x1000",
    "torchvision side: FrozenBatchNorm2d as separate ops, NCHW (xmodal: norm folded into the conv, "
    "channels-last)",
    "torchvision side: smooth-L1 (beta 1/9) box losses (xmodal: L1, detectron2), bbox_pred 4x1601 "
    "(xmodal: 4x1600), its GeneralizedRCNNTransform (a bilinear resize at scale 1, no padding)",
    "the same on both: ResNet-101 C4 trunk, res2 and stem frozen, RPN 3x3 conv 512 wide, 12 anchors at "
    "one level, RoIPool 14x14 (torchvision.ops.roi_pool, not MultiScaleRoIAlign), res5/layer4 stride 1 "
    "dilation 2 + mean pool, the same init recipe (He fan-out convs, 0.2 last-norm scale per block)",
)


def synthetic_batch(
    count: int, height: int, width: int, num_classes: int, num_attributes: int, device: str
) -> tuple[list[torch.Tensor], list[dict]]:
    """Mean-subtracted random images (3, h, w) and five random boxes each with classes and attributes
    (N, 3), padded with -1."""
    gen = torch.Generator().manual_seed(0)
    images, targets = [], []
    for _ in range(count):
        images.append((torch.rand(3, height, width, generator=gen) * 255 - 115).to(device))
        size = torch.rand(BOXES_PER_IMAGE, 2, generator=gen) * 0.4 + 0.1
        corner = torch.rand(BOXES_PER_IMAGE, 2, generator=gen) * (1 - size)
        scale = torch.tensor([width, height], dtype=torch.float32)
        boxes = torch.cat([corner * scale, (corner + size) * scale], dim=1)
        attributes = torch.randint(0, num_attributes, (BOXES_PER_IMAGE, ATTRIBUTES_PER_BOX), generator=gen)
        attributes[:, 1:][torch.rand(BOXES_PER_IMAGE, ATTRIBUTES_PER_BOX - 1, generator=gen) < 0.5] = -1
        classes = torch.randint(0, num_classes, (BOXES_PER_IMAGE,), generator=gen)
        targets.append(
            {"boxes": boxes.to(device), "classes": classes.to(device), "attributes": attributes.to(device)}
        )
    return images, targets


class RoIPoolLevel(nn.Module):
    """torchvision's box_roi_pool interface (features dict, proposals, image sizes) with RoIPool on the one
    res4 map, as xmodal pools."""

    def __init__(self, resolution: int, spatial_scale: float):
        super().__init__()
        self.resolution, self.spatial_scale = resolution, spatial_scale

    def forward(
        self, features: dict[str, torch.Tensor], proposals: list[torch.Tensor], image_shapes
    ) -> torch.Tensor:
        return roi_pool(features["0"], proposals, self.resolution, self.spatial_scale)


@torch.no_grad()
def torchvision_rcnn(preset: str, cfg: TrainingConfig, height: int, width: int) -> FasterRCNN:
    """torchvision's FasterRCNN configured to the preset's R-C4 network and training settings."""
    det = PRESETS[preset]
    trunk = resnet101(
        weights=None, norm_layer=FrozenBatchNorm2d, replace_stride_with_dilation=[False, False, True]
    )
    for block in trunk.modules():
        if isinstance(block, Bottleneck):  # xmodal's init: a small last-norm scale keeps 101 layers O(1)
            block.bn3.weight.fill_(0.2)
    backbone = nn.Sequential(
        trunk.conv1, trunk.bn1, trunk.relu, trunk.maxpool, trunk.layer1, trunk.layer2, trunk.layer3
    )
    backbone.out_channels = 1024
    for module in (trunk.conv1, trunk.layer1, trunk.layer2, trunk.layer3)[: cfg.freeze_at]:
        module.requires_grad_(False)
    anchors = AnchorGenerator((det.anchor_sizes,), (det.anchor_ratios,))
    num_anchors = anchors.num_anchors_per_location()[0]
    rpn_head = RPNHead(1024, num_anchors)
    # xmodal's RPN conv is rpn_channels (512) wide; torchvision's would be in_channels (1024)
    rpn_head.conv = nn.Sequential(
        Conv2dNormActivation(1024, det.rpn_channels, kernel_size=3, norm_layer=None)
    )
    rpn_head.cls_logits = nn.Conv2d(det.rpn_channels, num_anchors, 1)
    rpn_head.bbox_pred = nn.Conv2d(det.rpn_channels, num_anchors * 4, 1)
    for conv in rpn_head.modules():
        if isinstance(conv, nn.Conv2d):
            nn.init.normal_(conv.weight, std=0.01)
            nn.init.zeros_(conv.bias)
    predictor = FastRCNNPredictor(2048, det.num_classes + 1)
    nn.init.normal_(predictor.cls_score.weight, std=0.01)
    nn.init.normal_(predictor.bbox_pred.weight, std=0.001)
    model = FasterRCNN(
        backbone,
        num_classes=None,
        min_size=height,
        max_size=width,
        image_mean=[0.0, 0.0, 0.0],
        image_std=[1.0, 1.0, 1.0],
        size_divisible=1,
        rpn_anchor_generator=anchors,
        rpn_head=rpn_head,
        rpn_pre_nms_top_n_train=cfg.rpn_pre_nms_topk,
        rpn_post_nms_top_n_train=cfg.rpn_post_nms_topk,
        rpn_nms_thresh=det.rpn_nms_thresh,
        rpn_fg_iou_thresh=cfg.rpn_iou_thresholds[1],
        rpn_bg_iou_thresh=cfg.rpn_iou_thresholds[0],
        rpn_batch_size_per_image=cfg.rpn_batch_size,
        rpn_positive_fraction=cfg.rpn_positive_fraction,
        box_roi_pool=MultiScaleRoIAlign(["0"], det.pooler_resolution, sampling_ratio=0),
        box_head=nn.Sequential(trunk.layer4, nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        box_predictor=predictor,
        box_fg_iou_thresh=cfg.roi_iou_threshold,
        box_bg_iou_thresh=cfg.roi_iou_threshold,
        box_batch_size_per_image=cfg.roi_batch_size,
        box_positive_fraction=cfg.roi_positive_fraction,
        bbox_reg_weights=det.bbox_reg_weights,
    )
    # the constructor accepts only MultiScaleRoIAlign; RoIHeads itself takes any pooler
    model.roi_heads.box_roi_pool = RoIPoolLevel(det.pooler_resolution, 1.0 / 16)
    return model


def build_step(side: str, preset: str, cfg: TrainingConfig, height: int, width: int, device: str, lr: float):
    """A function doing one training iteration on (images, targets) with `rois` RoIs sampled per image ->
    the total loss."""
    if side == "xmodal":
        model = VGFasterRCNN(PRESETS[preset])
        init_random_weights(model)
        model.backbone.freeze(cfg.freeze_at)

        def losses(images: list[torch.Tensor], targets: list[dict], rois: int) -> dict[str, torch.Tensor]:
            return model(images, targets=targets, train_cfg=dataclasses.replace(cfg, roi_batch_size=rois))

    else:
        model = torchvision_rcnn(preset, cfg, height, width)

        def losses(images: list[torch.Tensor], targets: list[dict], rois: int) -> dict[str, torch.Tensor]:
            model.roi_heads.fg_bg_sampler.batch_size_per_image = rois
            # torchvision's labels: 0 is background, classes from 1
            return model(images, [{"boxes": t["boxes"], "labels": t["classes"] + 1} for t in targets])

    model.to(device).train()
    opt = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad],
        lr=lr,
        momentum=MOMENTUM,
        weight_decay=WEIGHT_DECAY,
    )

    def step(images: list[torch.Tensor], targets: list[dict], rois: int) -> float:
        loss = sum(losses(images, targets, rois).values())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def rss_mb(field: str) -> float:
    status = Path("/proc/self/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith(f"{field}:")) / 1024


def run_side(args, case: str, side: str) -> dict:
    """Build, warm up and time one side in this process; its times, losses and memory."""
    torch.manual_seed(0)
    preset = CASES[case]
    det = PRESETS[preset]
    cfg = training_config(preset)
    if case == "small":
        count, (height, width), rois = args.small_batch, args.small_size, cfg.roi_batch_size
        warmup, warmup_rois, iters = args.small_warmup, rois, args.small_iters
    else:
        count, (height, width), rois = 1, args.size, args.rois
        warmup, warmup_rois, iters = args.warmup, args.warmup_rois, args.iters
    step = build_step(side, preset, cfg, height, width, args.device, args.lr)
    images, targets = synthetic_batch(count, height, width, det.num_classes, det.num_attributes, args.device)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
        base = rss_mb("VmRSS")
    losses, times = [], []
    for i in range(warmup + iters):
        start = time.perf_counter()
        losses.append(step(images, targets, warmup_rois if i < warmup else rois))
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mb("VmHWM")
    return {
        "s_per_iter": statistics.median(times[warmup:]),
        "best_s_per_iter": min(times[warmup:]),
        "times": times[warmup:],
        "warmup_times": times[:warmup],
        "losses": losses,
        "resident_mb": base,
        "peak_growth_mb": peak - base,
        "batch": count,
        "input": [height, width],
        "rois_per_image": rois,
        "warmup_rois_per_image": warmup_rois,
    }


def child_command(args, case: str, side: str) -> list[str]:
    cmd = [sys.executable, __file__, "--child", case, side, "--device", args.device, "--lr", str(args.lr)]
    cmd += ["--size", *map(str, args.size), "--rois", str(args.rois)]
    cmd += ["--iters", str(args.iters), "--warmup", str(args.warmup), "--warmup-rois", str(args.warmup_rois)]
    cmd += ["--small-size", *map(str, args.small_size), "--small-batch", str(args.small_batch)]
    cmd += ["--small-iters", str(args.small_iters), "--small-warmup", str(args.small_warmup)]
    return cmd + (["--threads", str(args.threads)] if args.threads else [])


def run_child(args, case: str, side: str) -> dict:
    """One side in a fresh process, with the 1-minute load average around it."""
    load = os.getloadavg()[0]
    out = subprocess.run(child_command(args, case, side), capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{case}/{side} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    row = {
        **json.loads(out.stdout.strip().splitlines()[-1]),
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }
    print(
        f"{case}/{side}: warm-up {row['warmup_times']} s, timed {row['times']} s", file=sys.stderr, flush=True
    )
    return row


def print_table(rows: dict[str, dict], title: str) -> None:
    print(title)
    print(
        f"{'case/side':<17}{'input':>9}{'batch':>6}{'RoIs':>6}{'warm-up':>13}{'timed':>6}{'s/iter':>9}"
        f"{'best':>7}{'resident MB':>12}{'peak growth MB':>15}{'loss first/last':>18}{'load':>12}"
    )
    for name, r in rows.items():
        shape = f"{'x'.join(map(str, r['input'])):>9}{r['batch']:>6}{r['rois_per_image']:>6}"
        warm = f"{len(r['warmup_times'])}x{r['warmup_rois_per_image']} RoIs"
        speed = f"{len(r['times']):>6}{r['s_per_iter']:>9.2f}{r['best_s_per_iter']:>7.2f}"
        memory = f"{r['resident_mb']:>12.0f}{r['peak_growth_mb']:>15.0f}"
        losses = f"{r['losses'][0]:.2f}/{r['losses'][-1]:.2f}"
        load = f"{r['load_before']:.2f}/{r['load_after']:.2f}"
        print(f"{name:<17}{shape}{warm:>13}{speed}{memory}{losses:>18}{load:>12}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", nargs="+", choices=tuple(CASES), default=list(CASES))
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--quick", action="store_true", help="r101 at 300x500 with 128 RoIs; small: 1 + 3 steps"
    )
    parser.add_argument("--size", type=int, nargs=2, default=None, metavar=("H", "W"), help="r101 input")
    parser.add_argument("--rois", type=int, default=None, help="r101 RoIs per image (CPU: 256, CUDA: 512)")
    parser.add_argument("--iters", type=int, default=None, help="r101 timed steps per side")
    parser.add_argument("--warmup", type=int, default=None, help="r101 untimed steps per side")
    parser.add_argument("--warmup-rois", type=int, default=None, help="r101 RoIs per image in warm-up steps")
    parser.add_argument("--small-size", type=int, nargs=2, default=[224, 224], metavar=("H", "W"))
    parser.add_argument("--small-batch", type=int, default=4)
    parser.add_argument("--small-iters", type=int, default=None)
    parser.add_argument("--small-warmup", type=int, default=None)
    parser.add_argument(
        "--lr", type=float, default=0.02 * 0.001, help="default: detectron2's first warm-up lr"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    quick = {"size": [300, 500], "rois": 128, "warmup": 1, "warmup_rois": 32, "iters": 1}
    full = {"size": [600, 1000], "rois": 256, "warmup": 1, "warmup_rois": 32, "iters": 1}
    if cuda:  # the preset's RoI batch, warmed up at its own shapes
        rois = TrainingConfig().roi_batch_size
        full = {**full, "rois": rois, "warmup": 2, "warmup_rois": rois, "iters": 5}
    small = {"small_warmup": 1, "small_iters": 3} if args.quick else {"small_warmup": 2, "small_iters": 10}
    for key, value in {**(quick if args.quick else full), **small}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(run_side(args, *args.child)))
        return
    if cuda and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")

    load_before = os.getloadavg()
    rows = {f"{case}/{side}": run_child(args, case, side) for case in args.cases for side in SIDES[case]}
    device = (
        torch.cuda.get_device_name() if cuda else f"cpu ({args.threads or torch.get_num_threads()} threads)"
    )
    memory = "CUDA max_memory_allocated" if cuda else "VmHWM"
    print_table(
        rows,
        f"detector training step (forward + backward + SGD), {device}, float32, lr {args.lr:g}; "
        f"s/iter: median of the timed steps; peak growth: {memory} above the built model and data; "
        "load: 1-min load average before/after the side",
    )
    result: dict = {}
    if "r101/reference" in rows:
        ours, ref = rows["r101/xmodal"], rows["r101/reference"]
        result = {
            "ratio": ref["s_per_iter"] / ours["s_per_iter"],
            "memory_ratio": ref["peak_growth_mb"] / ours["peak_growth_mb"],
        }
        print(
            f"ratio (r101, torchvision s/iter / xmodal s/iter): {result['ratio']:.2f}; peak growth "
            f"torchvision / xmodal: {result['memory_ratio']:.2f}"
        )
        print("r101/reference = torchvision FasterRCNN; what differs:")
        for line in DIFFERENCES:
            print(f"  - {line}")
    print(
        json.dumps(
            {
                "name": "detector_train",
                "device": device,
                "lr": args.lr,
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
                **result,
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
