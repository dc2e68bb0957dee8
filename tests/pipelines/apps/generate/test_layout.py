"""Generation is one folder of apps, like `serve/` and `demo/` (issue 44), not five files beside them."""

from __future__ import annotations

import importlib
from pathlib import Path

import pipelines.apps

MODULES = ("sample", "rerank", "rerank_captioner", "rerank_matching", "evaluate")


def test_generation_is_a_package_beside_serve_and_demo():
    apps = Path(pipelines.apps.__file__).parent
    assert sorted(p.name for p in apps.glob("generate*.py")) == []
    assert (apps / "generate" / "__init__.py").is_file()
    for name in MODULES:
        importlib.import_module(f"pipelines.apps.generate.{name}")
