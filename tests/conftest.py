"""Shared test fixtures: the `../shared/` reference folder and a quiet, deterministic torch."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray runs its workers at nice 15 by default, so on a machine busy with other work (CI's neighbours) an
# actor's start-up can starve for many minutes: the tests' own clusters run theirs at normal priority.
os.environ.setdefault("RAY_worker_niceness", "0")
# caches the code keeps between runs (cached stores, record checks) go to a folder of this test session,
# never to the user's ~/.cache/xmodal
if "XMODAL_CACHE" not in os.environ:
    os.environ["XMODAL_CACHE"] = tempfile.mkdtemp(prefix="xmodal-test-cache-")
    atexit.register(shutil.rmtree, os.environ["XMODAL_CACHE"], True)


@pytest.fixture(scope="session")
def shared_reference() -> Path:
    """`../shared/reference/`, or skip where this checkout has no shared folder beside it."""
    ref = SHARED / "reference"
    if not ref.is_dir():
        pytest.skip(f"{ref} is absent: the reference files live outside the project (CI has them)")
    return ref


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def assert_legible():
    """Checks a drawn picture (`extraction.draw.Drawing`) of an image of `image_shape` (h, w): its size
    follows `picture_scale` (small images enlarged, large ones reduced); every label lies inside it and
    no two labels share a pixel (rectangles compared here, not with the drawing code's own test)."""
    from extraction.draw import MAX_SIDE, MIN_SIDE, MIN_WIDTH, picture_scale

    def check(drawing, image_shape: tuple[int, int]) -> None:
        h, w = image_shape
        scale = picture_scale(h, w)
        height, width = drawing.image.shape[:2]
        assert width == max(round(w * scale), MIN_WIDTH)
        assert height >= round(h * scale)
        shorter = min(round(h * scale), round(w * scale))
        assert shorter >= min(MIN_SIDE, round(MAX_SIDE * min(h, w) / max(h, w)))
        boxes = [label.box for label in drawing.labels]
        for x1, y1, x2, y2 in boxes:
            assert 0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height, (x1, y1, x2, y2)
        clashes = [
            (a, b)
            for k, a in enumerate(boxes)
            for b in boxes[k + 1 :]
            if a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
        ]
        assert clashes == [], f"labels overlap: {clashes[:3]}"

    return check
