"""Detector speed and fidelity on synthetic images with random weights (timings are representative, the
regions are not).

    python tests/benchmarks/bench_detector.py                      # xmodal alone: images/s by batch size
    python tests/benchmarks/bench_detector.py --reference          # vs detectron2's arithmetic, alternating
    python tests/benchmarks/bench_detector.py --compare-dtype bfloat16   # bf16 autocast vs float32
    python tests/benchmarks/bench_detector.py --device cuda --compare-dtype float16   # GPU rows

Size flags (the full preset is 600/1000 and 300 proposals; on a shared 2-core CPU one image then takes
~30 s a side): --min-size/--max-size (network input), --proposals (post-NMS RPN proposals = RoIs),
--images (timed images per side), --threads. --quick = 300/500, 50 proposals, 3 images.

`--reference`: the same weights run through a backbone and res5 written with detectron2's arithmetic
(conv -> F.batch_norm -> relu_, in-place residual, NCHW), image by image alternately with xmodal;
`ratio` = reference s/image / xmodal s/image (>1: xmodal faster). Also reported: whether both selected
the same regions, the largest relative feature difference, and res5's GFLOP/s against the machine's
float32 GEMM peak (a 2048^3 matmul on the same threads).
`--compare-dtype D`: D autocast vs float32 xmodal, alternating: `ratio` = float32 s/image / D s/image,
and per image how many of the float32 regions D finds again (IoU >= 0.9), their feature cosine and
label agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import nms

from extraction import Detector
from extraction.backbone import Conv2d
from extraction.detector import STAGES
from extraction.rcnn import ImageOutputs, StageTimer, VGFasterRCNN
from extraction.selection import SelectionConfig, select_caffe


def synthetic_images(n: int, h: int = 480, w: int = 640) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        cv2.resize(
            rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8), (w, h), interpolation=cv2.INTER_CUBIC
        )
        for _ in range(n)
    ]


def d2_conv(conv: Conv2d, x: torch.Tensor) -> torch.Tensor:
    """detectron2: bias-free conv, then FrozenBatchNorm2d's inference path (one F.batch_norm)."""
    y = F.conv2d(x, conv.weight, None, conv.stride, conv.padding, conv.dilation)
    n = conv.norm
    return F.batch_norm(y, n.running_mean, n.running_var, n.weight, n.bias, False, 0.0, n.eps)


def d2_stage(stage: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for block in stage:
        out = F.relu_(d2_conv(block.conv1, x))
        out = F.relu_(d2_conv(block.conv2, out))
        out = d2_conv(block.conv3, out)
        out += x if block.shortcut is None else d2_conv(block.shortcut, x)
        x = F.relu_(out)
    return x


class ReferenceRCNN(nn.Module):
    """xmodal's network and weights with detectron2's backbone and res5 arithmetic (the RPN and the
    predictor have no norm and are shared)."""

    def __init__(self, model: VGFasterRCNN):
        super().__init__()
        self.model = model

    def forward(self, images: list[torch.Tensor], stage: StageTimer) -> list[ImageOutputs]:
        m, out = self.model, []
        for image in images:
            with stage("backbone"):
                x = F.relu_(d2_conv(m.backbone.stem.conv1, image[None]))
                x = F.max_pool2d(x, kernel_size=3, stride=2, padding=0, ceil_mode=True)
                features = d2_stage(m.backbone.res4, d2_stage(m.backbone.res3, d2_stage(m.backbone.res2, x)))
            with stage("rpn"):
                boxes, objectness = m.proposal_generator(features, tuple(image.shape[-2:]))
            with stage("roi_head"):
                rois = torch.cat([boxes.new_zeros((boxes.shape[0], 1)), boxes], dim=1)
                x = d2_stage(m.roi_heads.res5, m.roi_heads.pooler(features, rois)).mean(dim=(2, 3))
                cls_logits, deltas, attr_logits = m.roi_heads.box_predictor(x)
            out.append(ImageOutputs(boxes, objectness, x, cls_logits, deltas, attr_logits))
        return out


def res5_gflop(det: Detector, rois: int) -> float:
    """Multiply-adds x 2 of res5 on `rois` pooled regions."""
    side = det.config.pooler_resolution
    macs = sum(
        conv.weight.numel() * side * side
        for conv in det.model.roi_heads.res5.modules()
        if isinstance(conv, Conv2d)
    )
    return 2 * macs * rois / 1e9


def gemm_peak_gflops(device: str, reps: int = 5) -> float:
    """The better of a 2048^3 matmul and the same GEMM as a channels-last 1x1 convolution (oneDNN; on
    some CPUs torch.mm's BLAS is the slower of the two)."""
    a, b = torch.randn(2048, 2048, device=device), torch.randn(2048, 2048, device=device)
    x = torch.randn(32, 2048, 8, 8, device=device).contiguous(memory_format=torch.channels_last)
    w = torch.randn(2048, 2048, 1, 1, device=device).contiguous(memory_format=torch.channels_last)
    best = 0.0
    for fn, flop in ((lambda: torch.mm(a, b), 2 * 2048**3), (lambda: F.conv2d(x, w), 2 * 2048 * 2048 * 2048)):
        fn()
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            best = max(best, flop / (time.perf_counter() - start) / 1e9)
    return best


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, 4) x (M, 4) -> (N, M)."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area = lambda x: (x[:, 2] - x[:, 0]) * (x[:, 3] - x[:, 1])  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None, :] - inter + 1e-9)


def fidelity(base, other) -> dict:
    """How many of `base`'s regions `other` finds again (IoU >= 0.9), their feature cosine, labels."""
    overlap = iou(base.boxes, other.boxes)
    matched, cosines, labels = 0, [], []
    taken = set()
    for i in range(base.num_boxes):
        for j in np.argsort(-overlap[i]):
            if overlap[i, j] < 0.9:
                break
            if j not in taken:
                taken.add(j)
                matched += 1
                a, b = base.features[i], other.features[j]
                cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12)))
                labels.append(int(base.objects_id[i] == other.objects_id[j]))
                break
    return {
        "regions": base.num_boxes,
        "same_regions": matched,
        "cosine_mean": float(np.mean(cosines)) if cosines else float("nan"),
        "cosine_min": float(np.min(cosines)) if cosines else float("nan"),
        "label_agreement": float(np.mean(labels)) if labels else float("nan"),
    }


def time_selection(proposals: int = 300, classes: int = 1600) -> tuple[float, float]:
    """(ours, reference) seconds for the caffe rule on a random score table."""
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(proposals, 2, generator=g) * 600
    boxes = torch.cat([xy, xy + torch.rand(proposals, 2, generator=g) * 300 + 8], dim=1)
    probs = torch.softmax(torch.randn(proposals, classes + 1, generator=g) * 2.5, dim=1)
    cfg = SelectionConfig()
    start = time.perf_counter()
    select_caffe(boxes, probs, cfg)
    ours = time.perf_counter() - start
    start = time.perf_counter()
    max_conf = torch.zeros(proposals)
    for c in range(classes):  # bottom-up-attention generate_tsv: one NMS per class
        keep = nms(boxes, probs[:, c], cfg.nms_thresh)
        max_conf[keep] = torch.maximum(max_conf[keep], probs[keep, c])
    return ours, time.perf_counter() - start


def build(args, dtype: str = "float32") -> Detector:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Detector.build(
            device=args.device,
            dtype=dtype,
            min_size=args.min_size,
            max_size=args.max_size,
            post_nms_topk=args.proposals,
            min_boxes=args.boxes,
            max_boxes=args.boxes,
        )


def alternate(sides: dict[str, Detector], images: list[np.ndarray]) -> tuple[dict, dict]:
    """Each image through every side in turn (after one warm-up image); per side, per-stage seconds/image
    and the records."""
    for det in sides.values():
        det.detect(images[:1])
    timings = {name: dict.fromkeys(STAGES, 0.0) for name in sides}
    records: dict[str, list] = {name: [] for name in sides}
    for i, image in enumerate(images):
        # who goes first alternates too, so neither side always inherits the other's cache and allocator state
        for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
            records[name].append(sides[name].detect([image], ids=[str(i)], timings=timings[name])[0])
    per_image = {name: {k: v / len(images) for k, v in t.items()} for name, t in timings.items()}
    return per_image, records


def print_stages(per_image: dict[str, dict]) -> None:
    print(f"{'s/image':>14}" + "".join(f"{k:>12}" for k in (*STAGES, "total")))
    for name, t in per_image.items():
        print(f"{name:>14}" + "".join(f"{v:>12.3f}" for v in (*t.values(), sum(t.values()))))


def run_reference(args, images) -> dict:
    det = build(args)
    # the reference network has only the per-image forward
    ref = Detector(
        ReferenceRCNN(det.model), det.config, det.selection, det.preset, det._weights, forward="per-image"
    )
    per_image, records = alternate({"reference": ref, "xmodal": det}, images)
    print_stages(per_image)
    # the same regions: equal count and labels, boxes equal up to float rounding (the proposals' RPN
    # inputs differ in the last bits)
    same, worst, box_diff = True, 0.0, 0.0
    for a, b in zip(records["reference"], records["xmodal"], strict=True):
        same &= a.num_boxes == b.num_boxes and np.array_equal(a.objects_id, b.objects_id)
        if a.num_boxes == b.num_boxes:
            same &= bool(np.allclose(a.boxes, b.boxes, rtol=1e-4, atol=1e-2))
            box_diff = max(box_diff, float(np.abs(a.boxes - b.boxes).max(initial=0.0)))
            scale = np.abs(a.features).max(initial=1e-12)
            worst = max(worst, float(np.abs(a.features - b.features).max(initial=0.0) / scale))
    rois = np.mean([r.num_boxes for r in records["xmodal"]])  # only for the summary line
    gflop = res5_gflop(det, args.proposals)
    peak = gemm_peak_gflops(args.device)
    selection, selection_reference = time_selection()
    ref_s, ours_s = (sum(per_image[k].values()) for k in ("reference", "xmodal"))
    result = {
        "ratio": ref_s / ours_s,
        "reference_s_per_image": ref_s,
        "xmodal_s_per_image": ours_s,
        "roi_head_ratio": per_image["reference"]["roi_head"] / per_image["xmodal"]["roi_head"],
        "backbone_ratio": per_image["reference"]["backbone"] / per_image["xmodal"]["backbone"],
        "same_regions": bool(same),
        "max_feature_rel_diff": worst,
        "max_box_diff_px": box_diff,
        "res5_gflops": gflop / per_image["xmodal"]["roi_head"],
        "gemm_peak_gflops": peak,
        "selection_ms": 1000 * selection,
        "selection_reference_ms": 1000 * selection_reference,
        "selection_ratio": selection_reference / selection,
        "stages": per_image,
    }
    print(
        f"ratio {result['ratio']:.2f} (roi head {result['roi_head_ratio']:.2f}, backbone "
        f"{result['backbone_ratio']:.2f}); same regions: {same} (boxes within {box_diff:.1e} px); max "
        f"feature diff {worst:.1e} (relative); "
        f"{rois:.0f} regions kept/image"
    )
    print(
        f"res5 on {args.proposals} RoIs: {result['res5_gflops']:.0f} GFLOP/s (whole RoI head) vs "
        f"GEMM peak {peak:.0f} GFLOP/s = {result['res5_gflops'] / peak:.0%}"
    )
    print(
        f"caffe selection (300 x 1600): {1000 * selection:.0f} ms vs per-class NMS loop "
        f"{1000 * selection_reference:.0f} ms"
    )
    return result


def run_dtype(args, images) -> dict:
    sides = {"float32": build(args), args.compare_dtype: build(args, args.compare_dtype)}
    per_image, records = alternate(sides, images)
    print_stages(per_image)
    rows = [fidelity(a, b) for a, b in zip(records["float32"], records[args.compare_dtype], strict=True)]
    base_s, low_s = (sum(per_image[k].values()) for k in sides)
    result = {
        "ratio": base_s / low_s,
        "float32_s_per_image": base_s,
        f"{args.compare_dtype}_s_per_image": low_s,
        "roi_head_ratio": per_image["float32"]["roi_head"] / per_image[args.compare_dtype]["roi_head"],
        "same_regions": [r["same_regions"] for r in rows],
        "regions": [r["regions"] for r in rows],
        "cosine_mean": float(np.nanmean([r["cosine_mean"] for r in rows])),
        "cosine_min": float(np.nanmin([r["cosine_min"] for r in rows])),
        "label_agreement": float(np.nanmean([r["label_agreement"] for r in rows])),
        "stages": per_image,
    }
    print(
        f"ratio {result['ratio']:.2f}; same regions {result['same_regions']} of {result['regions']}; "
        f"feature cosine mean {result['cosine_mean']:.5f} min {result['cosine_min']:.5f}; "
        f"label agreement {result['label_agreement']:.3f}"
    )
    return result


def run_batches(args, images) -> dict:
    det = build(args, args.dtype)
    det.detect(images[:1])
    rows = []
    for batch in args.batches:
        timings: dict[str, float] = {}
        start = time.perf_counter()
        det.detect(images[:batch], timings=timings)
        total = time.perf_counter() - start
        rows.append(
            {"batch": batch, "images_per_s": batch / total, **{k: timings[k] / batch for k in STAGES}}
        )
        print(
            f"batch {batch}: {batch / total:.3f} images/s  "
            + "  ".join(f"{k} {timings[k] / batch:.3f}s" for k in STAGES)
        )
    return {"rows": rows, "ratio": rows[-1]["images_per_s"] / rows[0]["images_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--reference", action="store_true", help="alternate with detectron2's arithmetic")
    mode.add_argument("--compare-dtype", choices=("bfloat16", "float16"), default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the CUDA rows: --device cuda)")
    parser.add_argument("--dtype", default="float32", help="dtype of the batch-size mode")
    parser.add_argument("--quick", action="store_true", help="300/500 input, 50 proposals, 3 images")
    parser.add_argument("--min-size", type=int, default=None)
    parser.add_argument("--max-size", type=int, default=None)
    parser.add_argument("--proposals", type=int, default=None, help="RoIs per image (post-NMS top-k)")
    parser.add_argument("--boxes", type=int, default=36, help="regions kept (min = max)")
    parser.add_argument("--images", type=int, default=None, help="timed images per side")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="batch-size mode only")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    quick = {"min_size": 300, "max_size": 500, "proposals": 50, "images": 3}
    full = {"min_size": 600, "max_size": 1000, "proposals": 300, "images": 3}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    images = synthetic_images(max(args.images, max(args.batches)) + 1)[1:]
    load_before = os.getloadavg()
    with torch.inference_mode():
        if args.reference:
            result = run_reference(args, images[: args.images])
        elif args.compare_dtype:
            result = run_dtype(args, images[: args.images])
        else:
            result = run_batches(args, images)
    cuda = args.device.startswith("cuda")
    device = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    print(
        json.dumps(
            {
                "name": "detector",
                "mode": "reference" if args.reference else (args.compare_dtype or "batches"),
                "device": device,
                "input": [args.min_size, args.max_size],
                "proposals": args.proposals,
                "images": args.images,
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
                **result,
            }
        )
    )


if __name__ == "__main__":
    main()
