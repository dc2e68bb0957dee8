"""The server's Generate tab through FastAPI's TestClient: a prompt in, n PNG images out best first, scored
by the transformer's likelihood (or, with a captioner held, its likelihood of the prompt on the samples'
regions), each score recomputed here; refusals are JSON with their status."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from extraction.preprocess import resize_image
from pipelines.apps.generate.rerank import image_log_likelihood
from pipelines.apps.generate.rerank_captioner import caption_log_likelihood
from pipelines.apps.generate.sample import SampleSettings, sample_tokens
from pipelines.apps.serve.app import create_app
from pipelines.apps.serve.backend import Backend, load_backend
from pipelines.apps.serve.config import ServeConfig
from pipelines.apps.serve.generation import HeldGenerator
from pipelines.tasks.text_to_image import TextToImageModel

PROMPT = "a red square and a blue circle"


@pytest.fixture(scope="module")
def drawing_only(dalle_run):
    """A server that holds only the text-to-image model (no detector)."""
    with TestClient(create_app(load_backend(None, generate_checkpoint=dalle_run), ServeConfig())) as client:
        yield client


def images_of(body: dict) -> list[np.ndarray]:
    out = []
    for entry in body["images"]:
        head, data = entry["png"].split(",", 1)
        assert head == "data:image/png;base64"
        out.append(np.asarray(Image.open(io.BytesIO(base64.b64decode(data)))))
    return out


def test_a_prompt_gets_n_images_best_first_by_the_transformers_likelihood(drawing_only, dalle_run):
    response = drawing_only.post("/api/generate", data={"prompt": PROMPT, "n": "3", "seed": "5"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["rerank"] == "likelihood" and "log p(image tokens | prompt)" in body["reranker"]
    pictures = images_of(body)
    assert len(pictures) == 3 and all(p.shape == (16, 16, 3) for p in pictures)

    model = TextToImageModel.load(dalle_run)
    tokens = sample_tokens(model, PROMPT, SampleSettings(n=3, top_p=0.9, seed=5))
    expected = image_log_likelihood(model, PROMPT, tokens).tolist()
    assert [e["sample"] for e in body["images"]] == sorted(range(3), key=lambda i: -expected[i])
    np.testing.assert_allclose(
        [e["score"] for e in body["images"]], sorted(expected, reverse=True), rtol=1e-5
    )


def test_a_prompt_longer_than_the_model_reads_says_so(drawing_only):
    """Issue 46: a long prompt was cut to the transformer's text length without a word."""
    short = drawing_only.post("/api/generate", data={"prompt": "a red square", "n": "1"}).json()
    long = drawing_only.post("/api/generate", data={"prompt": "red " * 100, "n": "1"}).json()
    assert short["prompt_cut"] is None
    assert (
        "the model reads the prompt's first" in long["prompt_cut"]
        and "of its 100 words" in long["prompt_cut"]
    )


def test_the_same_seed_draws_the_same_images(drawing_only):
    a = drawing_only.post("/api/generate", data={"prompt": PROMPT, "n": "2", "rerank": "none"}).json()
    b = drawing_only.post("/api/generate", data={"prompt": PROMPT, "n": "2", "rerank": "none"}).json()
    assert [e["png"] for e in a["images"]] == [e["png"] for e in b["images"]]
    assert [e["sample"] for e in a["images"]] == [0, 1]  # none keeps the sampling order


def test_guidance_draws_what_the_guided_sampler_draws(drawing_only, dalle_run):
    model = TextToImageModel.load(dalle_run)
    tokens = sample_tokens(model, PROMPT, SampleSettings(n=2, top_p=0.9, seed=3, guidance=50.0))
    # the tiny model's prompt effect is small: a large scale makes the guided draw differ from the plain one
    assert not torch.equal(tokens, sample_tokens(model, PROMPT, SampleSettings(n=2, top_p=0.9, seed=3)))
    fields = {"prompt": PROMPT, "n": "2", "seed": "3", "rerank": "none", "guidance": "50"}
    body = drawing_only.post("/api/generate", data=fields).json()
    assert body["guidance"] == 50.0
    with torch.no_grad():
        expected = (model.dvae.decode(tokens.view(2, 4, 4)).clamp(0, 1) * 255).round().to(torch.uint8)
    pictures = images_of(body)
    assert len(pictures) == 2
    assert all(np.array_equal(p, e.permute(1, 2, 0).numpy()) for p, e in zip(pictures, expected, strict=True))


@pytest.mark.parametrize(
    ("fields", "status", "message"),
    [
        ({"prompt": "  "}, 400, "prompt is empty"),
        ({"prompt": "zebra tulip"}, 400, "no word of the prompt 'zebra tulip' is in the model's vocabulary"),
        ({"prompt": PROMPT, "n": "0"}, 400, "n must be between 1 and 16"),
        ({"prompt": PROMPT, "top_p": "1.5"}, 400, "top_p"),
        ({"prompt": PROMPT, "guidance": "-1"}, 400, "guidance must lie in [0, 100]"),
        ({"prompt": PROMPT, "seed": str(2**70)}, 400, "seed must lie in [0, 4294967295]"),
        ({"prompt": PROMPT, "seed": "-1"}, 400, "seed must lie in"),
        ({"prompt": PROMPT, "rerank": "clip"}, 400, "rerank must be one of"),
        ({"prompt": PROMPT, "rerank": "captioner"}, 400, "--caption-checkpoint"),
    ],
)
def test_bad_requests_are_json_errors(drawing_only, fields, status, message):
    response = drawing_only.post("/api/generate", data=fields)
    assert response.status_code == status and message in response.json()["error"]


def test_a_drawing_only_server_says_so_on_image_endpoints_and_in_health(drawing_only):
    health = drawing_only.get("/api/health").json()
    assert health["generate"]["image_size"] == 16 and health["detector"] is None
    response = drawing_only.post("/api/regions", files={"image": ("x.png", b"\x89PNG", "image/png")})
    assert response.status_code == 501 and "/api/generate" in response.json()["error"]


def test_a_server_without_a_generator_answers_501(backend):
    with TestClient(create_app(backend, ServeConfig())) as client:
        response = client.post("/api/generate", data={"prompt": PROMPT})
    assert response.status_code == 501 and "--generate-checkpoint" in response.json()["error"]


def test_with_a_captioner_the_samples_are_ranked_by_its_likelihood_of_the_prompt(backend, dalle_run):
    held = HeldGenerator.load(dalle_run)
    both = Backend(backend.detector, backend.answerer, backend.captioner, generator=held)
    with TestClient(create_app(both, ServeConfig())) as client:
        body = client.post("/api/generate", data={"prompt": PROMPT, "n": "3", "seed": "2"}).json()
    assert body["rerank"] == "captioner" and body["reranker"].startswith("captioner updown")

    tokens = sample_tokens(held.model, PROMPT, SampleSettings(n=3, top_p=0.9, seed=2))
    with torch.no_grad():
        samples = held.model.dvae.decode(tokens.view(3, 4, 4))
    bgr = [
        (s.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()[:, :, ::-1] for s in samples
    ]
    min_size, max_size = backend.working_size
    regions = backend.detect(
        [resize_image(np.ascontiguousarray(b), min_size, max_size) for b in bgr],
        [f"s{i}" for i in range(3)],
        [(16, 16)] * 3,
    )
    expected = caption_log_likelihood(backend.captioner.tuned, PROMPT, regions).tolist()
    assert [e["sample"] for e in body["images"]] == sorted(range(3), key=lambda i: -expected[i])
    np.testing.assert_allclose(
        [e["score"] for e in body["images"]], sorted(expected, reverse=True), rtol=1e-4
    )


@pytest.mark.slow
def test_the_pages_generate_tab_shows_the_images_best_first(dalle_run):
    """In headless system Chromium: the tab appears for a drawing-only server, and a prompt fills the
    gallery with the API's images in its order."""
    import shutil

    import requests

    from .conftest import serving

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no system Chromium (Debian package `chromium`)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed")
    app = create_app(load_backend(None, generate_checkpoint=dalle_run), ServeConfig())
    with serving(app) as url, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        page.set_default_timeout(60_000)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url + "/")
        page.wait_for_selector("#generate-tab:not([hidden])")
        assert "text-to-image" in page.text_content("#loaded")
        page.fill("#prompt", PROMPT)
        page.fill("#samples", "3")
        page.click("#generate")
        page.wait_for_function("document.querySelectorAll('#gallery img').length === 3")
        shown = [page.get_attribute(f"#gallery figure:nth-child({i + 1}) img", "src") for i in range(3)]
        browser.close()
        body = requests.post(url + "/api/generate", data={"prompt": PROMPT, "n": "3"}, timeout=60).json()
    assert shown == [e["png"] for e in body["images"]]
    assert not errors
