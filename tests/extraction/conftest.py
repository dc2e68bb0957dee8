"""A small-input random-weight detector shared by the extraction tests (R101 on CPU is slow)."""

from __future__ import annotations

import dataclasses
import warnings

import cv2
import numpy as np
import pytest
import torch

from extraction import Detector

SMALL = {"min_size": 64, "max_size": 96, "post_nms_topk": 8}


@pytest.fixture(scope="session")
def small_detector() -> Detector:
    """Random weights, images resized to 64..96 px, 8 proposals, 2..6 regions (caffe rule)."""
    torch.set_num_threads(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Detector.build(min_boxes=2, max_boxes=6, **SMALL)


@pytest.fixture(scope="session")
def reselect():
    """reselect(det, **changes): the same network and weights with other selection settings."""

    def make(det: Detector, **changes) -> Detector:
        selection = dataclasses.replace(det.selection, **changes)
        return Detector(det.model, det.config, selection, det.preset, det._weights)

    return make


@pytest.fixture(scope="session")
def make_image():
    """make_image(seed, h, w): a BGR uint8 image of smooth colour blobs (more structure than noise)."""

    def make(seed: int, h: int, w: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        small = rng.integers(0, 256, size=(max(h // 8, 2), max(w // 8, 2), 3), dtype=np.uint8)
        return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)

    return make
