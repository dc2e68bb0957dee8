"""Fixtures for the server tests: a tiny fine-tuned checkpoint, its backend, and a server on a free port."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from pipelines.apps.serve.backend import Backend, load_backend
from pipelines.apps.serve.config import ServeConfig
from pipelines.apps.serve.http_server import make_server

from .tiny_models import write_tiny_captioner, write_tiny_checkpoint


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("serve")
    return write_tiny_checkpoint(root), write_tiny_captioner(root)


@pytest.fixture(scope="session")
def checkpoint(models):
    return models[0]


@pytest.fixture(scope="session")
def caption_checkpoint(models):
    return models[1]


@pytest.fixture(scope="session")
def backend(checkpoint, caption_checkpoint) -> Iterator[Backend]:
    """The detector the checkpoints' features were made with (random weights, 96 px input), the VQA model
    and the captioner."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models gain nothing from threads on the shared 2-core machine
    with pytest.warns(UserWarning, match="RANDOM weights"):
        loaded = load_backend(checkpoint, caption_checkpoint=caption_checkpoint)
    yield loaded
    torch.set_num_threads(before)


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Run `app` as `xmodal serve` runs it, on a free loopback port in a thread; yields its base URL."""
    server = make_server(app, ServeConfig(port=0), log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def scene_png(width: int = 120, height: int = 96, shift: int = 0) -> bytes:
    """A grey picture with a red square and a blue disc, PNG-encoded."""
    img = Image.new("RGB", (width, height), (200, 200, 200))
    draw = ImageDraw.Draw(img)
    draw.rectangle((10 + shift, 10, 50 + shift, 50), fill=(220, 30, 30))
    draw.ellipse((60, 40, 110, 90), fill=(30, 60, 220))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def decoded(png: bytes) -> np.ndarray:
    """The BGR array the server decodes from `png`."""
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))[:, :, ::-1].copy()
