"""Shared test fixtures: the `../shared/` reference folder and a quiet, deterministic torch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
