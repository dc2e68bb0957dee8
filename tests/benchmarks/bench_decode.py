"""Peak memory of decoding one 49 MP image for the detector: the full decode then resize (`extract`)
against `load_resized` (`serve`), each in a fresh process; prints a table and a JSON line.

    .venv/bin/python tests/benchmarks/bench_decode.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SIDE = 7000  # 49 MP, under the 50 MP limit
CHILD = """
import resource, sys
from extraction.preprocess import DECODE_BYTES_PER_PIXEL, decode_bytes, load_image, load_resized, resize_image
data = open(sys.argv[1], "rb").read()
base = int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[2] == "full":
    resize_image(load_image(data), 600, 1000)
else:
    load_resized(data, "x", 600, 1000)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(peak - base, decode_bytes(data, "x", 600, 1000) // DECODE_BYTES_PER_PIXEL)
"""


def images(folder: Path) -> dict[str, Path]:
    rgb = Image.new("RGB", (SIDE, SIDE), (120, 30, 200))
    made = {
        "WebP (lossless)": ("big.webp", rgb, {"lossless": True}),
        "PNG RGB": ("big.png", rgb, {}),
        "PNG 16-bit": ("big16.png", Image.fromarray(np.full((SIDE, SIDE), 30000, np.uint16)), {}),
        "JPEG": ("big.jpg", rgb, {"quality": 90}),
    }
    paths = {}
    for label, (name, img, kwargs) in made.items():
        img.save(folder / name, **kwargs)
        paths[label] = folder / name
    return paths


def peak(path: Path, how: str) -> tuple[int, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), how], capture_output=True, text=True, env=env
    )
    out.check_returncode()
    grew, pixels = out.stdout.split()
    return int(grew), int(pixels)


def main() -> None:
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in images(Path(tmp)).items():
            full, _ = peak(path, "full")
            reduced, pixels = peak(path, "reduced")
            rows[label] = {
                "bytes": path.stat().st_size,
                "full_mib": full / 2**20,
                "load_resized_mib": reduced / 2**20,
                "decoded_mpx": pixels / 1e6,
                "bytes_per_decoded_px": reduced / pixels,
            }
    print(f"{'image':<16} {'file':>9} {'full MiB':>9} {'serve MiB':>10} {'decoded MP':>11} {'B/px':>6}")
    for label, r in rows.items():
        print(
            f"{label:<16} {r['bytes']:>9} {r['full_mib']:>9.0f} {r['load_resized_mib']:>10.0f} "
            f"{r['decoded_mpx']:>11.1f} {r['bytes_per_decoded_px']:>6.1f}"
        )
    full = sum(r["full_mib"] for r in rows.values())
    reduced = sum(r["load_resized_mib"] for r in rows.values())
    print(
        json.dumps({"name": "decode_peak_memory", "device": "cpu", "images": rows, "ratio": full / reduced})
    )


if __name__ == "__main__":
    main()
