"""The page in headless system Chromium driven by Playwright: upload, regions, question, answer, caption
and its attention over time."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import requests

from pipelines.apps.serve.app import create_app

from .conftest import scene_png, serving
from .tiny_models import ANSWERS, BOXES

# where test runs leave files for people to look at (git ignores build/)
ARTIFACTS = Path(
    os.environ.get("XMODAL_TEST_ARTIFACTS", Path(__file__).parents[4] / "build" / "test-artifacts")
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (Debian package `chromium`)"),
    pytest.mark.slow,
]


def overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def test_the_page_draws_the_regions_shows_the_answer_the_caption_and_each_words_attention(backend, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed")
    image = tmp_path / "scene.png"
    image.write_bytes(scene_png())
    elsewhere: list[str] = []
    with serving(create_app(backend)) as url, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.set_default_timeout(120_000)  # the detector takes seconds an image on a busy CPU
        page.route(
            "**/*",
            lambda route: (
                route.continue_()
                if route.request.url.startswith(url)
                else (elsewhere.append(route.request.url), route.abort())
            ),
        )
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url + "/")
        page.wait_for_selector("#warning:not([hidden])")  # the random-weights detector is announced
        assert "vqa model" in page.text_content("#loaded")

        page.set_input_files("#image", str(image))
        page.wait_for_function(f"document.getElementById('canvas').dataset.drawn === '{BOXES}'")
        assert page.locator("#regions li").count() == BOXES
        regions = requests.post(
            url + "/api/regions", files={"image": ("scene.png", scene_png(), "image/png")}, timeout=60
        ).json()["regions"]
        # the first region's top edge is stroked over the image: its pixel is no longer the scene's
        width = page.evaluate("document.getElementById('canvas').width")
        scale = width / 120
        x1, y1, x2, _ = regions[0]["box"]
        x, y = round((x1 + x2) / 2 * scale), round(y1 * scale)
        pixel = page.evaluate(f"Array.from(canvas.getContext('2d').getImageData({x}, {y}, 1, 1).data)")
        assert pixel[:3] not in ([200, 200, 200], [220, 30, 30], [30, 60, 220]), pixel

        page.fill("#question", "what color is the square?")
        page.click("#ask")
        page.wait_for_selector("#result:not([hidden])")
        answer = page.text_content("#answer")
        assert answer in ANSWERS
        asked = requests.post(
            url + "/api/ask",
            files={"image": ("scene.png", scene_png(), "image/png")},
            data={"question": "what color is the square?"},
            timeout=60,
        ).json()
        assert answer == asked["answer"]
        assert page.locator("#answers li").count() == len(asked["answers"])
        assert page.locator("#attended li").count() == len(asked["attended"]) == 5
        assert page.evaluate("canvas.dataset.attended") == "5"
        assert page.is_hidden("#error") and errors == []

        page.click("#describe")
        page.wait_for_selector("#caption-result:not([hidden])")
        captioned = requests.post(
            url + "/api/caption", files={"image": ("scene.png", scene_png(), "image/png")}, timeout=60
        ).json()
        words = [w["word"] for w in captioned["words"]]
        assert len(words) >= 2
        assert page.text_content("#caption") == captioned["caption"]
        assert page.locator("#words .word").all_text_contents() == words
        assert page.evaluate("canvas.dataset.word") == "0"  # the first word's attention is drawn at once
        page.locator("#words .word").nth(1).click()
        assert page.evaluate("canvas.dataset.word") == "1"
        assert page.text_content("#words .word.current") == words[1]
        assert page.locator("#word-attended li").count() == len(captioned["words"][1]["attended"]) == 5
        assert page.evaluate("canvas.dataset.attended") == "5"
        labels = json.loads(page.evaluate("canvas.dataset.labels"))
        assert len(labels) == 5 and not any(
            overlap(a, b) for i, a in enumerate(labels) for b in labels[i + 1 :]
        ), labels  # the ranks of boxes sharing a corner are printed on separate lines
        page.click("#play")  # attention over time: the words take turns until the last
        page.wait_for_function(f"canvas.dataset.word === '{len(words) - 1}'", timeout=30_000)
        page.wait_for_function("document.getElementById('play').textContent === 'Play'", timeout=5_000)
        assert page.is_hidden("#error") and errors == []
        screenshot = tmp_path / "serve-page.png"
        page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    assert elsewhere == []  # the page asked for nothing outside the server: it works offline
    assert screenshot.stat().st_size > 10_000
    kept = ARTIFACTS / screenshot.name  # kept after the run, unlike tmp_path
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(screenshot, kept)
    print(f"screenshot of the page: {kept}")
