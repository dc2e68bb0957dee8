"""The server over HTTP on a loopback port: each endpoint, bad uploads, queue bound, timeouts, batching."""

from __future__ import annotations

import re
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests

from pipelines.apps.ask import ask
from pipelines.apps.caption import caption_regions
from pipelines.apps.serve.app import STATIC_DIR, create_app
from pipelines.apps.serve.backend import Backend
from pipelines.apps.serve.config import ServeConfig
from storage import RegionFeatures

from .conftest import decoded, scene_png, serving
from .tiny_models import ANSWERS, BOXES, CAPTIONS

QUESTION = "what color is the square?"


class Gated(Backend):
    """The real backend whose detector calls wait until `gate` is set; `entered` tells one has begun."""

    def __init__(self, backend: Backend):
        super().__init__(backend.detector, backend.answerer, backend.captioner)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def detect(self, images, ids, original_sizes=None):
        self.entered.set()
        assert self.gate.wait(60)
        return super().detect(images, ids, original_sizes)


@pytest.fixture(scope="module")
def url(backend):
    with serving(create_app(backend, ServeConfig(max_upload_mb=0.25))) as base:
        yield base


@pytest.fixture(scope="module")
def reference(backend):
    """The detector's regions for the scene, computed without the server."""
    (regions,) = backend.detect([decoded(scene_png())], ["scene.png"])
    return regions


def post(
    url: str, path: str, png: bytes | None = None, name: str = "scene.png", **fields
) -> requests.Response:
    files = {"image": (name, png, "image/png")} if png is not None else None
    return requests.post(url + path, files=files, data=fields, timeout=120)


def pending(url: str) -> int:
    return requests.get(url + "/api/health", timeout=10).json()["queue"]["pending"]


def wait_until(condition, what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_health_says_what_is_loaded(url, checkpoint, caption_checkpoint):
    health = requests.get(url + "/api/health", timeout=10).json()
    assert health["status"] == "ok"
    assert health["model"] == {
        "checkpoint": str(checkpoint),
        "task": "vqa",
        "arch": "lxmert",
        "answers": len(ANSWERS),
    }
    assert health["caption"] == {"checkpoint": str(caption_checkpoint), "task": "caption", "arch": "updown"}
    assert health["detector"]["weights"] == "random" and health["detector"]["min_size"] == 96
    assert health["queue"] == {"pending": 0, "max_pending": ServeConfig().max_pending}


def test_regions_are_the_detectors_on_the_uploaded_image(url, reference):
    response = post(url, "/api/regions", scene_png())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["image"] == {"name": "scene.png", "width": 120, "height": 96}
    regions = body["regions"]
    assert len(regions) == BOXES == reference.num_boxes
    np.testing.assert_allclose([r["box"] for r in regions], reference.boxes, atol=0.01)
    np.testing.assert_allclose([r["object_score"] for r in regions], reference.objects_conf, rtol=1e-5)
    np.testing.assert_allclose([r["attribute_score"] for r in regions], reference.attrs_conf, rtol=1e-5)
    for r, obj, attr in zip(regions, reference.objects_id, reference.attrs_id, strict=True):
        assert (r["object_id"], r["attribute_id"], r["label"]) == (obj, attr, f"attr{attr} obj{obj}")


def test_ask_returns_the_models_answers_and_its_attention_over_the_regions(url, backend, reference):
    response = post(url, "/api/ask", scene_png(), question=f"  {QUESTION} ", top_k="3")
    assert response.status_code == 200, response.text
    body = response.json()
    expected = ask(backend.answerer.tuned, reference, QUESTION, top_k=3)
    assert body["question"] == QUESTION
    assert [a["answer"] for a in body["answers"]] == [a for a, _ in expected.answers]
    np.testing.assert_allclose(
        [a["score"] for a in body["answers"]], [s for _, s in expected.answers], rtol=1e-5
    )
    assert (body["answer"], body["score"]) == (body["answers"][0]["answer"], body["answers"][0]["score"])
    assert body["answer"] in ANSWERS
    attention = np.array([r["attention"] for r in body["regions"]])
    np.testing.assert_allclose(attention, expected.attention, rtol=1e-5)
    assert attention.sum() == pytest.approx(1.0, abs=1e-5)
    assert body["attended"] == sorted(range(BOXES), key=lambda i: -attention[i])[:5]
    np.testing.assert_allclose([r["box"] for r in body["regions"]], reference.boxes, atol=0.01)


def test_labels_name_attributes_and_objects_from_the_vocabularies(backend):
    objects = [f"thing{i}" for i in range(1600)]
    attributes = [f"look{i}" for i in range(400)]
    named = Backend(backend.detector, backend.answerer, None, objects, attributes)
    with serving(create_app(named)) as base:
        regions = post(base, "/api/regions", scene_png()).json()["regions"]
    assert [r["label"] for r in regions] == [
        f"{attributes[r['attribute_id']]} {objects[r['object_id']]}" for r in regions
    ]


def test_caption_returns_the_captioners_words_and_each_words_attention_over_the_regions(
    url, backend, reference
):
    response = post(url, "/api/caption", scene_png(), beam_size="2")
    assert response.status_code == 200, response.text
    body = response.json()
    expected = caption_regions(backend.captioner.tuned, reference, beam_size=2)
    assert body["caption"] == expected.caption == " ".join(w["word"] for w in body["words"])
    assert body["beam_size"] == 2 and body["image"] == {"name": "scene.png", "width": 120, "height": 96}
    assert expected.words and set(expected.words) <= {w for caption in CAPTIONS for w in caption}
    attention = np.array([w["attention"] for w in body["words"]])
    np.testing.assert_allclose(attention, expected.attentions, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(attention.sum(1), 1.0, rtol=1e-5)
    for word, weights in zip(body["words"], attention, strict=True):
        assert word["attended"] == sorted(range(BOXES), key=lambda i: -weights[i])[:5]
    np.testing.assert_allclose([r["box"] for r in body["regions"]], reference.boxes, atol=0.01)
    default = post(url, "/api/caption", scene_png()).json()  # the server's --beam-size, 3
    assert default["beam_size"] == 3
    assert default["caption"] == caption_regions(backend.captioner.tuned, reference, beam_size=3).caption


@pytest.mark.parametrize(
    ("held", "path", "fields", "message"),
    [
        (
            "answerer",
            "/api/caption",
            {},
            "this server holds no captioner: start `xmodal serve` with",
        ),
        ("captioner", "/api/ask", {"question": QUESTION}, "this server holds no question-answering model"),
    ],
)
def test_a_server_without_the_model_an_endpoint_needs_answers_a_json_501(
    backend, held, path, fields, message
):
    one = Backend(backend.detector, **{held: getattr(backend, held)})
    with serving(create_app(one)) as base:
        health = requests.get(base + "/api/health", timeout=10).json()
        assert (health["model"] is None, health["caption"] is None) == (
            held != "answerer",
            held != "captioner",
        )
        response = post(base, path, scene_png(), **fields)
        assert response.status_code == 501 and message in response.json()["error"]
        after = requests.get(base + "/api/health", timeout=10).json()
        assert after["batching"]["detector_calls"] == 0  # refused before the detector ran


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header announces width x height pixels, with almost no data behind it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 8))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    ("path", "png", "fields", "status", "message"),
    [
        ("/api/regions", b"hello, not an image", {}, 400, "'notes.txt' is not an image"),
        ("/api/regions", b"", {}, 400, "empty (0-byte)"),
        ("/api/regions", png_claiming(10_000, 6_000), {}, 400, "60.0 MP, above the 50 MP limit"),
        ("/api/regions", b"\0" * 300_000, {}, 413, "larger than the server's 0.25 MiB limit"),
        ("/api/regions", None, {}, 400, "image: Field required"),
        ("/api/ask", scene_png(), {}, 400, "question: Field required"),
        ("/api/ask", scene_png(), {"question": "   "}, 400, "the question is empty"),
        ("/api/ask", scene_png(), {"question": "x" * 501}, 400, "501 characters, above the 500 limit"),
        (
            "/api/ask",
            scene_png(),
            {"question": "what?", "top_k": "0"},
            400,
            "top_k must be between 1 and 100",
        ),
        ("/api/ask", scene_png(), {"question": "what?", "top_k": "many"}, 400, "top_k: Input should be"),
        ("/api/caption", scene_png(), {"beam_size": "0"}, 400, "beam_size must be between 1 and 20, got 0"),
        ("/api/caption", b"GIF89a", {}, 400, "'notes.txt' is not an image"),
    ],
)
def test_bad_requests_get_a_json_error_that_says_what_to_fix(url, path, png, fields, status, message):
    response = post(url, path, png, name="notes.txt", **fields)
    assert response.status_code == status
    assert message in response.json()["error"]
    if any(m in message for m in ("not an image", "empty (0-byte)", "MP limit")):
        # the fix for an upload, not extraction's "remove it" (from the input folder)
        assert response.json()["error"].endswith("; upload another image (JPEG, PNG, ...)")


def test_a_chunked_upload_over_the_limit_is_cut_off_with_a_json_413(url):
    def chunks():
        yield b"--b\r\nContent-Disposition: form-data; name=image; filename=x.png\r\n\r\n"
        for _ in range(40):
            yield b"\0" * 10_000

    response = requests.post(
        url + "/api/regions",
        data=chunks(),
        headers={"Content-Type": "multipart/form-data; boundary=b"},
        timeout=60,
    )
    assert response.status_code == 413
    assert "0.25 MiB limit" in response.json()["error"]


def test_unknown_paths_and_methods_get_json_errors(url):
    missing = requests.get(url + "/api/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json() == {"error": "Not Found"}
    wrong = requests.get(url + "/api/ask", timeout=10)
    assert wrong.status_code == 405 and wrong.json() == {"error": "Method Not Allowed"}


def test_the_page_and_its_files_are_served_and_load_nothing_from_elsewhere(url):
    page = requests.get(url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("app.js", "style.css"):
        assert f"/static/{name}" in page.text
        assert requests.get(f"{url}/static/{name}", timeout=10).status_code == 200
    for path in STATIC_DIR.iterdir():  # offline: no absolute URL anywhere, so no CDN, font or analytics
        assert not re.search(r"(https?:)?//[a-z]", path.read_text()), path


def test_requests_beyond_the_bound_get_503_while_those_admitted_share_a_detector_call(backend, reference):
    gated = Gated(backend)
    app = create_app(gated, ServeConfig(max_pending=3, max_batch=8, max_wait_ms=0))
    with serving(app) as base, ThreadPoolExecutor(3) as pool:
        first = pool.submit(post, base, "/api/regions", scene_png())
        assert gated.entered.wait(30)
        queued = [
            pool.submit(post, base, "/api/ask", scene_png(), question=QUESTION),
            pool.submit(post, base, "/api/caption", scene_png()),
        ]
        wait_until(lambda: pending(base) == 3, "three requests are in flight")
        wait_until(lambda: app.state.service.detector.queued() == 2, "two images wait for the detector")
        refused = post(base, "/api/regions", scene_png())
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert "server busy: 3 requests are already waiting" in refused.json()["error"]
        gated.gate.set()
        responses = [first.result(120)] + [f.result(120) for f in queued]
        assert [r.status_code for r in responses] == [200, 200, 200]
        assert list(app.state.service.detector.recent_sizes) == [
            1,
            2,
        ]  # the two queued images shared one call
        for body in (r.json() for r in responses):
            np.testing.assert_allclose([r["box"] for r in body["regions"]], reference.boxes, atol=0.01)
        assert pending(base) == 0


def test_requests_time_out_with_a_json_504_and_queued_work_is_dropped(backend):
    gated = Gated(backend)
    app = create_app(gated, ServeConfig(timeout_s=0.5, max_wait_ms=0))
    with serving(app) as base, ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, base, "/api/regions", scene_png())
        assert gated.entered.wait(30)
        queued = pool.submit(post, base, "/api/ask", scene_png(), question=QUESTION)
        for response in (running.result(60), queued.result(60)):
            assert response.status_code == 504
            assert "timed out after 0.5 s waiting for the models" in response.json()["error"]
        gated.gate.set()
    assert list(app.state.service.detector.recent_sizes) == [1]  # the timed-out queued request never ran


class Faulty(Backend):
    """The real model behind a detector that finds nothing in 'blank.png' and breaks on 'broken.png'."""

    def __init__(self, backend: Backend):
        super().__init__(backend.detector, backend.answerer, backend.captioner)

    def detect(self, images, ids, original_sizes=None):
        if "broken.png" in ids:
            raise RuntimeError("CUDA error: device-side assert")
        empty = np.zeros((0, 4), np.float32), np.zeros((0, 2048), np.float32)
        none = np.zeros(0, np.int64), np.zeros(0, np.float32)
        return [RegionFeatures(name, 96, 120, *empty, *none, *none) for name in ids]


def test_the_models_refusals_are_422_and_failures_500_both_as_json(backend):
    with serving(create_app(Faulty(backend))) as base:
        refused = post(base, "/api/ask", scene_png(), name="blank.png", question=QUESTION)
        assert refused.status_code == 422
        assert refused.json() == {"error": "the detector found no region in 'blank.png'; nothing to look at"}
        failed = post(base, "/api/regions", scene_png(), name="broken.png")
        assert failed.status_code == 500
        assert failed.json() == {
            "error": "internal error (RuntimeError: CUDA error: device-side assert); see the server log"
        }


def test_a_body_shorter_than_its_content_length_gets_a_json_408(backend):
    """Issue 46: the server held such a request for 90 s; each part of a body now waits body_timeout_s."""
    import json
    import socket

    with serving(create_app(backend, ServeConfig(body_timeout_s=1))) as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            started = time.monotonic()
            sock.sendall(
                b"POST /api/ask HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                b"Content-Length: 1000\r\n\r\nquestion=what"
            )
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        seconds = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 408") and seconds < 15, (reply[:200], seconds)
    assert "stopped arriving" in json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
