"""README.md is a front page: short, the first commands on its first screen, your own images on the
second, the same own-images block as the manual's (which a test runs), and links that lead somewhere."""

from __future__ import annotations

import re

from tests.docs.pages import DOCS, README, REPO, blocks

SCREEN = 40  # lines a terminal or a browser shows without scrolling


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_the_first_commands_are_on_the_first_screen() -> None:
    first = "\n".join(README.read_text().splitlines()[:SCREEN])
    assert "make demo" in first and "make test" in first
    assert re.search(r"takes .*minutes", first), "the first screen says how long the demo takes"


def test_your_own_images_is_on_the_second_screen() -> None:
    lines = README.read_text().splitlines()
    start = lines.index("## Your own images")
    own = [b for b in blocks(README) if b.line > start + 1][0]
    assert start < 2 * SCREEN and own.line < 2 * SCREEN + 10
    # the manual's block, which tests/pipelines/commands/test_own_images.py runs as written
    assert own.text == blocks(DOCS / "own-images.md")[0].text
    assert own.marker == blocks(DOCS / "own-images.md")[0].marker


def test_the_readme_links_lead_somewhere() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert "docs/index.md" in targets or any(t.startswith("docs/") for t in targets)
    for target in targets:
        if not target.startswith("http"):
            assert (REPO / target).exists(), target
