"""The server's decoding budget: uploads wait their turn in arrival order and are refused with a message
when the wait runs out; eight near-limit uploads at once stay within the budget's memory."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests
from PIL import Image

from pipelines.apps.serve.app import create_app
from pipelines.apps.serve.config import ServeConfig
from pipelines.apps.serve.decode_budget import DecodeBudget
from pipelines.apps.serve.service import ServiceError

from .conftest import serving

MIB = 2**20


def test_uploads_wait_in_arrival_order_and_each_is_let_in_when_it_fits():
    async def scenario() -> list[str]:
        budget = DecodeBudget(100, wait_s=5)
        order: list[str] = []

        async def decode(name: str, cost: int, hold: float) -> None:
            await budget.acquire(cost, name)
            order.append(name)
            await asyncio.sleep(hold)
            budget.release(cost)

        first = asyncio.create_task(decode("a", 70, 0.05))
        await asyncio.sleep(0)
        big = asyncio.create_task(decode("big", 90, 0.0))
        await asyncio.sleep(0)
        small = asyncio.create_task(decode("small", 10, 0.0))  # would fit now, but "big" came first
        await asyncio.gather(first, big, small)
        assert budget.used == 0 and budget.waiting == 0
        return order

    assert asyncio.run(scenario()) == ["a", "big", "small"]


def test_an_upload_waiting_too_long_gets_503_and_leaves_the_queue():
    async def scenario() -> None:
        budget = DecodeBudget(100, wait_s=0.05)
        await budget.acquire(80, "held")
        with pytest.raises(ServiceError) as refused:
            await budget.acquire(30, "late.webp")
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        assert "server busy decoding other images" in refused.value.message
        assert "--max-decode-mb" in refused.value.message
        assert budget.waiting == 0
        budget.release(80)
        await budget.acquire(100, "next")  # nothing of the refused upload is still counted
        assert budget.used == 100

    asyncio.run(scenario())


def test_one_image_above_the_whole_budget_is_413_at_once(backend):
    out = io.BytesIO()
    Image.new("RGB", (4000, 4000), (10, 200, 30)).save(out, "WEBP", lossless=True)
    body = out.getvalue()
    with serving(create_app(backend, ServeConfig(max_decode_mb=64))) as base:
        answer = requests.post(
            base + "/api/regions", files={"image": ("flat.webp", body, "image/webp")}, timeout=60
        )
        health = requests.get(base + "/api/health", timeout=60).json()
    assert answer.status_code == 413
    assert answer.json()["error"].startswith("image 'flat.webp' needs about 259 MiB to decode, above the ")
    assert health["decoding"] == {"budget_mb": 64, "in_use_mb": 0.0, "waiting": 0}


PEAK_SCRIPT = textwrap.dedent(
    """
    import io, json, sys, threading
    import requests
    from PIL import Image
    from pipelines.apps.serve.app import create_app
    from pipelines.apps.serve.backend import load_backend
    from pipelines.apps.serve.config import ServeConfig
    from tests.pipelines.apps.serve.conftest import scene_png, serving

    def resident(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    checkpoint, captioner, budget_mb = sys.argv[1], sys.argv[2], float(sys.argv[3])
    out = io.BytesIO()
    Image.new("RGB", (7000, 7000), (120, 30, 200)).save(out, "WEBP", lossless=True)  # 49 MP
    big = out.getvalue()
    backend = load_backend(checkpoint, caption_checkpoint=captioner)
    with serving(create_app(backend, ServeConfig(max_decode_mb=budget_mb))) as base:
        post = lambda name, data: requests.post(
            base + "/api/regions", files={"image": (name, data, "image/webp")}, timeout=600
        )
        assert post("warm.png", scene_png()).status_code == 200
        open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from here
        before = resident("VmRSS")
        answers = [None] * 8

        def send(i):
            answer = post(f"big{i}.webp", big)
            answers[i] = (answer.status_code, answer.json())

        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        peak = resident("VmHWM")
    print(json.dumps({"size": len(big), "before": before, "peak": peak, "answers": answers}))
    """
)


@pytest.mark.slow
def test_eight_near_limit_uploads_stay_within_the_budget(checkpoint, caption_checkpoint, tmp_path):
    """Each 49 MP WebP (under 2 KB on the wire) costs ~790 MiB to decode; without a budget eight at once
    took about 5 GB. With the default 1024 MiB budget they decode one at a time."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure the peak resident memory")
    budget_mb = ServeConfig().max_decode_mb
    root = Path(__file__).resolve().parents[4]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(checkpoint), str(caption_checkpoint), str(budget_mb)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["size"] < 5000
    grew = result["peak"] - result["before"]
    assert grew <= budget_mb * MIB, f"peak grew {grew / MIB:.0f} MiB over the {budget_mb:g} MiB budget"
    assert grew > 0.5 * budget_mb * MIB  # the measurement sees the decoding (one image ~790 MiB)
    for status, body in result["answers"]:
        assert (status, sorted(body)) in ((200, ["image", "regions", "seconds"]), (503, ["error"]))
        if status == 200:
            assert (body["image"]["width"], body["image"]["height"]) == (7000, 7000)
        else:
            assert "decoding budget" in body["error"]
    assert any(status == 200 for status, _ in result["answers"])
