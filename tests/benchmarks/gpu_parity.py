"""Float32 regions on the device against the CPU's per-image path (the reference), with weights whose
scores separate: a trained detector (`--weights`, e.g. the demo's runs/detector/best) or the seeded random
one with a peaked class head (its logits scaled to a spread of LOGIT_STD across classes, so each region's
best class wins clearly and regions' confidences lie apart; random weights alone score every one of the
1,601 classes ~1/1601). Prints a table and one JSON line.

"The same regions" is defined with a margin at the 36th score: both sides keep 37 regions; an image
whose 36th and 37th reference confidences lie within `--margin` of each other may swap them under any
rounding, so it is counted apart ("tied"), not as a difference. For every other image the 36 best
regions must have the same classes, boxes within 1e-3 px and features within 1e-5 relative.

    python tests/benchmarks/gpu_parity.py --device cuda                 # R101-C4, 600/1000, 300 RoIs
    python tests/benchmarks/gpu_parity.py --device cpu --quick          # the check itself, in seconds
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

KEEP = 36
REL_TOL = 1e-5  # features: max |difference| / max |feature| of the image
BOX_TOL = 1e-3  # pixels
LOGIT_STD = 3.0  # the peaked random head's class logits: their spread over classes
FULL = dict(preset="vg-r101-c4", overrides={}, shape=(480, 640), images=8)
QUICK = dict(
    preset="c4-small", overrides=dict(min_size=96, max_size=160, post_nms_topk=60), shape=(150, 200), images=3
)


def images(n: int, shape: tuple[int, int]) -> list[np.ndarray]:
    """Smooth colour blobs (BGR uint8), every other one in portrait."""
    import cv2

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        h, w = shape if i % 2 == 0 else shape[::-1]
        small = rng.integers(0, 256, size=(max(h // 16, 2), max(w // 16, 2), 3), dtype=np.uint8)
        out.append(cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC))
    return out


def build(setup: dict, device: str, forward: str, weights: str | None, peak: float = 1.0):
    """A float32 detector keeping KEEP + 1 regions; random weights get their class head times `peak`."""
    from extraction import Detector

    det = Detector.build(
        setup["preset"],
        weights=weights,
        device=device,
        forward=forward,
        dtype="float32",
        min_boxes=KEEP + 1,
        max_boxes=KEEP + 1,
        **setup["overrides"],
    )
    if weights is None:
        sharpen(det, peak)
    return det


def sharpen(det, peak: float) -> None:
    """The class head's logits times `peak`."""
    with torch.no_grad():
        head = class_head(det)
        head.weight.mul_(peak)
        head.bias.mul_(peak)


def class_head(det) -> torch.nn.Module:
    return next(m for name, m in det.model.named_modules() if name.endswith("cls_score"))


def peak_for(det, picture: np.ndarray) -> float:
    """The factor that gives the class logits of `picture`'s proposals a spread of LOGIT_STD."""
    seen: list[float] = []
    hook = class_head(det).register_forward_hook(lambda m, i, out: seen.append(float(out.std(dim=-1).mean())))
    try:
        det.detect([picture], ["peak"])
    finally:
        hook.remove()
    return LOGIT_STD / max(seen[0], 1e-12)


def best(record, k: int) -> np.ndarray:
    """Indices of the record's `k` most confident regions, most confident first (stable on ties)."""
    return np.argsort(-np.asarray(record.objects_conf), kind="stable")[:k]


def compare(want: list, got: list, margin: float) -> dict:
    same, tied, differ, worst, box_diff, margins = 0, 0, [], 0.0, 0.0, []
    for exp, rec in zip(want, got, strict=True):
        conf = np.sort(np.asarray(exp.objects_conf))[::-1]
        gap = float(conf[KEEP - 1] - conf[KEEP]) if len(conf) > KEEP else float("inf")
        margins.append(gap)
        if gap <= margin:
            tied += 1
            continue
        a, b = best(exp, KEEP), best(rec, KEEP)
        ok = len(a) == len(b) and np.array_equal(exp.objects_id[a], rec.objects_id[b])
        if ok:
            boxes = float(np.abs(exp.boxes[a] - rec.boxes[b]).max()) if len(a) else 0.0
            scale = max(float(np.abs(exp.features[a]).max()), 1e-12) if len(a) else 1.0
            rel = float(np.abs(exp.features[a] - rec.features[b]).max()) / scale if len(a) else 0.0
            ok = boxes <= BOX_TOL and rel <= REL_TOL
            box_diff, worst = max(box_diff, boxes), max(worst, rel)
        if ok:
            same += 1
        else:
            differ.append(exp.img_id)
    return {
        "same": same,
        "tied": tied,
        "differ": differ,
        "max_box_diff_px": box_diff,
        "max_feature_rel_diff": worst,
        "smallest_margin": min(margins) if margins else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="the small C4 network on 3 small images")
    ap.add_argument("--images", type=int, help="images compared (default: 8; quick: 3)")
    ap.add_argument("--weights", help="a trained detector (directory or file); default: peaked random head")
    ap.add_argument("--forward", default="auto", help="the device's path: auto, batched or per-image")
    ap.add_argument("--margin", type=float, default=1e-4, help="36th-37th confidence gap counted as a tie")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    setup = QUICK if args.quick else FULL
    pictures = images(args.images or setup["images"], setup["shape"])
    ids = [f"img{i}" for i in range(len(pictures))]
    ref = build(setup, "cpu", "per-image", args.weights)
    peak = 1.0
    if not args.weights:
        peak = peak_for(ref, pictures[0])
        sharpen(ref, peak)
    start = time.perf_counter()
    want = ref.detect(pictures, ids)
    cpu_s = time.perf_counter() - start
    det = build(setup, args.device, args.forward, args.weights, peak)
    start = time.perf_counter()
    got = det.detect(pictures, ids)
    device_s = time.perf_counter() - start
    result = compare(want, got, args.margin)
    ok = not result["differ"] and result["same"] > 0
    print(f"{'images':<10}{'same':>6}{'tied':>6}{'differ':>8}{'box px':>10}{'feature rel':>13}")
    print(
        f"{len(pictures):<10}{result['same']:>6}{result['tied']:>6}{len(result['differ']):>8}"
        f"{result['max_box_diff_px']:>10.2e}{result['max_feature_rel_diff']:>13.2e}"
    )
    line = {
        "name": "gpu_parity",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "preset": setup["preset"],
        "weights": args.weights or f"random, class head x{peak:.3g} (logit spread {LOGIT_STD:g})",
        "forward": det.forward_path,
        "images": len(pictures),
        **result,
        "cpu_s": round(cpu_s, 2),
        "device_s": round(device_s, 2),
        "ratio": round(cpu_s / max(device_s, 1e-9), 2),
        "ok": ok,
    }
    print(json.dumps(line))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
