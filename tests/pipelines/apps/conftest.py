"""Fixtures for the DALL-E re-ranker tests: a tiny DALL-E run, and a c4-small detector (random weights)
whose classes are the demo's shapes and attributes its colours."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from extraction.config import PRESETS, SMALL_PRESET
from extraction.rcnn import VGFasterRCNN, init_random_weights
from extraction.weights import save_detector_dir
from model.dalle import DalleConfig, DalleTransformer, DiscreteVAE, DVAEConfig
from pipelines.apps.demo.synthetic import COLOURS, SHAPES
from pipelines.data.captions import Vocabulary
from pipelines.tasks.text_to_image import DVAE_DIR, VOCAB_FILE

WORDS = ["a", "and", *COLOURS, *SHAPES]


@pytest.fixture(scope="module")
def dalle_run(tmp_path_factory):
    torch.manual_seed(0)
    vocab = Vocabulary(WORDS)
    dvae = DiscreteVAE(
        DVAEConfig(image_size=16, downsample=4, hidden_size=8, codebook_size=7, blocks_per_group=1)
    )
    cfg = DalleConfig(
        text_vocab_size=len(vocab), text_length=8, image_vocab_size=7, image_grid=4,
        num_layers=1, num_heads=2, hidden_size=16, conv_kernel=3,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("dalle") / "best"
    DalleTransformer(cfg).save_pretrained(directory)
    vocab.save(directory / VOCAB_FILE)
    dvae.save_pretrained(directory / DVAE_DIR)
    return directory.parent


@pytest.fixture(scope="module")
def detector_dir(tmp_path_factory):
    config = dataclasses.replace(PRESETS[SMALL_PRESET], min_size=64, max_size=96, post_nms_topk=20)
    model = VGFasterRCNN(config)
    init_random_weights(model, 3)
    directory = tmp_path_factory.mktemp("det") / "best"
    save_detector_dir(model.eval(), config, SMALL_PRESET, list(SHAPES), list(COLOURS), directory)
    return directory
