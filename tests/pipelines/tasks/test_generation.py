"""DALL-E's tokenizer task on the engine: it trains from an image folder, saves a loadable dVAE directory,
and a resumed run (annealing counter included) ends exactly where an uninterrupted one does."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from model.dalle import DiscreteVAE
from pipelines.engine.launch import fit
from pipelines.engine.trainer import TrainConfig
from pipelines.tasks.generation import TokenizerTask, TokenizerTaskConfig, psnr

TINY = {"image_size": 16, "codebook_size": 11, "hidden_size": 8, "blocks_per_group": 1, "downsample": 4}


@pytest.fixture
def images(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(10):
        Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(folder / f"{i:02d}.png")
    return folder


def _task(folder) -> TokenizerTask:
    cfg = TokenizerTaskConfig(images=str(folder), dvae={**TINY, "kl_anneal_steps": 3}, valid_every=5)
    return TokenizerTask(cfg)


def _train(max_steps: int) -> TrainConfig:
    return TrainConfig(
        lr=1e-3, batch_size=4, max_steps=max_steps, trackers=[], loader_workers=0, save_every=2
    )


def test_resumed_tokenizer_run_matches_an_uninterrupted_one(images, tmp_path):
    torch.set_num_threads(1)
    task = _task(images)
    assert len(task.train_paths) == 8 and len(task.valid_paths) == 2
    fit(task, _train(4), tmp_path / "straight")
    # The same run stopped after its step-2 checkpoint: drop what came later, then resume.
    fit(_task(images), _train(4), tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "step-4")
    shutil.rmtree(tmp_path / "split" / "last")
    fit(_task(images), _train(4), tmp_path / "split", resume=True)
    straight = DiscreteVAE.from_pretrained(tmp_path / "straight" / "last").state_dict()
    resumed = DiscreteVAE.from_pretrained(tmp_path / "split" / "last").state_dict()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    state = torch.load(
        sorted((tmp_path / "split" / "checkpoints").glob("step-*"))[-1] / "trainer_state.pt",
        weights_only=True,
    )
    assert int(state["model"]["micro_steps"]) == 4  # the annealing schedule's position travels with it


def test_an_unreadable_image_is_named(images, tmp_path):
    (images / "03.png").write_bytes(b"not a png")
    task = _task(images)
    with pytest.raises(ValueError, match=r"image '.*03\.png' cannot be read"):
        task.train_dataset()[3]


def test_psnr_is_the_textbook_formula():
    a = torch.zeros(1, 3, 4, 4)
    b = torch.full((1, 3, 4, 4), 0.1)
    assert torch.allclose(psnr(a, b), torch.tensor([20.0]))


def test_evaluation_counts_the_codes_the_held_out_images_use(images):
    torch.manual_seed(0)
    task = _task(images)
    model = task.build_model().eval()
    batch = task.collate([task.valid_dataset()[i] for i in range(2)], np.random.default_rng(0))
    metrics = task.evaluate(model, [batch])
    logits = model.dvae.encoder(2 * 0.4 * batch["images"] + 0.1)  # map_pixels written out, eps 0.1
    assert metrics["codes_used"] == len(set(logits.argmax(1).flatten().tolist()))


def test_a_short_run_ends_the_annealing_within_it():
    from pipelines.commands.generate import fit_schedule_to_run
    from pipelines.tasks.generation import TokenizerRun

    short = fit_schedule_to_run(TokenizerRun(train=TrainConfig(max_steps=200)))
    assert short.task.dvae == {"temperature_anneal_steps": 200, "kl_anneal_steps": 200}
    chosen = TokenizerRun(train=TrainConfig(max_steps=200))
    chosen.task.dvae = {"temperature_anneal_steps": 1000}  # the user's own schedule is kept
    assert fit_schedule_to_run(chosen).task.dvae == {"temperature_anneal_steps": 1000, "kl_anneal_steps": 200}
    assert fit_schedule_to_run(TokenizerRun(train=TrainConfig(max_steps=5000))).task.dvae == {}
