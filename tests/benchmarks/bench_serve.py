"""Benchmark: `xmodal serve` requests/s and latency percentiles, detector batching on vs off.

Starts two `xmodal serve` child processes (a tiny random-weight VQA model, the random-weight VG detector
at the checkpoint's recorded 96 px input, small generated images): one with `--max-batch 1` (batching
off), one with `--max-batch 8 --max-wait-ms 5` (on). Clients post `POST /api/ask` from 1 and 4 threads
for a fixed time per cell, split into rounds in which the two servers take turns, so that the machine's
changing load hits both alike. Prints a table and one JSON line; `ratio` = batched ÷ unbatched
requests/s at each concurrency.

    .venv/bin/python tests/benchmarks/bench_serve.py                 # 20 s per cell, about 2 min
    .venv/bin/python tests/benchmarks/bench_serve.py --seconds 5     # quicker, noisier
    .venv/bin/python tests/benchmarks/bench_serve.py --device cuda --min-size 600 --max-size 1000
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.pipelines.apps.serve.tiny_models import write_tiny_checkpoint  # noqa: E402

MODES = {"off": ["--max-batch", "1", "--max-wait-ms", "0"], "on": ["--max-batch", "8", "--max-wait-ms", "5"]}


def scenes(count: int, width: int, height: int) -> list[bytes]:
    """Small PNGs, each with a square and a disc in different places and colours."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        img = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(150, 255, 3)))
        draw = ImageDraw.Draw(img)
        x, y = (int(v) for v in rng.integers(0, min(width, height) // 2, 2))
        draw.rectangle(
            (x, y, x + width // 3, y + height // 3), fill=tuple(int(v) for v in rng.integers(0, 255, 3))
        )
        draw.ellipse((width // 2, height // 3, width - 4, height - 4), fill=(30, 60, 220))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(checkpoint: Path, mode: str, args, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "serve",
        "--checkpoint",
        str(checkpoint),
        "--port",
        str(port),
    ]
    cmd += ["--device", args.device, *MODES[mode]]
    if args.min_size:
        cmd += ["--min-size", str(args.min_size)]
    if args.max_size:
        cmd += ["--max-size", str(args.max_size)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
        try:
            requests.get(url + "/api/health", timeout=1).raise_for_status()
            return proc, url
        except requests.RequestException:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start in 300 s:\n{log_path.read_text()[-3000:]}")


def load(url: str, images: list[bytes], clients: int, seconds: float) -> tuple[list[float], float]:
    """`clients` threads posting questions back to back for `seconds`: each latency (s) and the wall time."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(k: int) -> None:
        session = requests.Session()
        i = k
        while time.monotonic() < stop:
            files = {"image": (f"scene{i}.png", images[i % len(images)], "image/png")}
            started = time.perf_counter()
            r = session.post(url + "/api/ask", files=files, data={"question": "what color is the square?"})
            took = time.perf_counter() - started
            with lock:
                (latencies.append(took) if r.status_code == 200 else failures.append(r.text[:200]))
            i += clients

    began = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise SystemExit(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return latencies, time.perf_counter() - began


def detector_counts(url: str) -> tuple[int, int]:
    batching = requests.get(url + "/api/health", timeout=10).json()["batching"]
    return batching["detector_calls"], batching["images"]


def summary(latencies: list[float], wall: float, calls: int, images: int) -> dict:
    ms = np.array(latencies) * 1000
    return {
        "requests": len(latencies),
        "rps": len(latencies) / wall,
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_batch": images / max(calls, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="load time per cell (default: 20)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds the time is split into")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--min-size", type=int, help="detector input shortest side (default: recorded, 96)")
    parser.add_argument("--max-size", type=int, help="detector input longest side (default: recorded, 128)")
    parser.add_argument("--width", type=int, default=120)
    parser.add_argument("--height", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()

    images = scenes(16, args.width, args.height)
    load_before = os.getloadavg()[0]
    cells = {
        (m, c): {"latencies": [], "wall": 0.0, "calls": 0, "images": 0}
        for m in MODES
        for c in args.concurrency
    }
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_tiny_checkpoint(Path(tmp))
        servers = {m: start_server(checkpoint, m, args, Path(tmp) / f"server-{m}.log") for m in MODES}
        try:
            for _, url in servers.values():
                for _ in range(2):  # warm-up: first-call costs (allocator, lazy initialisation)
                    requests.post(url + "/api/ask", files={"image": images[0]}, data={"question": "what?"})
            for _ in range(args.rounds):
                for c in args.concurrency:
                    for mode, (_, url) in servers.items():
                        calls, done = detector_counts(url)
                        latencies, wall = load(url, images, c, args.seconds / args.rounds)
                        calls_after, done_after = detector_counts(url)
                        cell = cells[mode, c]
                        cell["latencies"] += latencies
                        cell["wall"] += wall
                        cell["calls"] += calls_after - calls
                        cell["images"] += done_after - done
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    rows = {mode: {c: summary(**cells[mode, c]) for c in args.concurrency} for mode in MODES}

    print(
        f"{'batching':>8} {'clients':>7} {'requests':>8} {'req/s':>7} "
        f"{'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'batch':>6}"
    )
    for mode, cells in rows.items():
        for c, r in cells.items():
            print(
                f"{mode:>8} {c:>7} {r['requests']:>8} {r['rps']:>7.2f} "
                f"{r['p50_ms']:>8.0f} {r['p90_ms']:>8.0f} {r['p99_ms']:>8.0f} {r['mean_batch']:>6.2f}"
            )
    ratio = {c: rows["on"][c]["rps"] / rows["off"][c]["rps"] for c in args.concurrency}
    for c, value in ratio.items():
        print(f"ratio (batched ÷ unbatched req/s) at {c} clients: {value:.2f}")
    print(
        json.dumps(
            {
                "bench": "serve",
                "device": args.device,
                "image": [args.width, args.height],
                "seconds": args.seconds,
                "rounds": args.rounds,
                "cpus": os.cpu_count(),
                "load_before": load_before,
                "python": platform.python_version(),
                "results": {m: {str(c): r for c, r in cells.items()} for m, cells in rows.items()},
                "ratio": {str(c): v for c, v in ratio.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
