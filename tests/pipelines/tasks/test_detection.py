"""Detector training on generated scenes (c4-small at 64-128 px): exact resume, and Ray Train workers that
reach the weights one process reaches at the same global batch."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pipelines.apps.demo.synthetic import SyntheticConfig, generate
from pipelines.cli import main as xmodal
from pipelines.engine import config_io
from pipelines.engine.run_log import read_metrics
from pipelines.tasks.detection import DetectionTask, default_run, train_detector

pytestmark = pytest.mark.usefixtures("one_thread")

# small inputs and RoI samples keep a step well under a second on 2 cores
SMALL_IMAGES = {"min_sizes": [64, 80], "max_size": 128}
SMALL_TEST_SIZE = {"min_size": 64, "max_size": 128}


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """12 scenes of 64 px with one or two shapes (8 for training)."""
    return generate(tmp_path_factory.mktemp("scenes"), SyntheticConfig(num_images=12, image_size=64))


@pytest.fixture(scope="module")
def single_objects(tmp_path_factory):
    """12 scenes of 64 px with one shape each (10 for training)."""
    cfg = SyntheticConfig(
        num_images=12, image_size=64, max_shapes=1, valid_fraction=0.1, test_fraction=0.1, seed=1
    )
    return generate(tmp_path_factory.mktemp("single_objects"), cfg)


def _train_argv(data, out, *extra: str) -> list[str]:
    overrides = [f"task.training.{k}={v}" for k, v in SMALL_IMAGES.items()]
    overrides += [f"task.detector.{k}={v}" for k, v in SMALL_TEST_SIZE.items()]
    return [
        "detector",
        "train",
        "--preset",
        "c4-small",
        "--images",
        str(data.images_dir),
        "--annotations",
        str(data.detection["train"]),
        "--out",
        str(out),
        "--batch-size",
        "2",
        "--lr",
        "0.005",
        *extra,
        *overrides,
        "task.training.roi_batch_size=32",
        "train.loader_workers=0",
        "train.log_every=1",
        # the warm-up spans the interruption: the resumed run must pick the rate up where it was
        "train.warmup_iters=3",
    ]


def _losses(run) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def test_resume_equals_an_uninterrupted_run(scenes, tmp_path, capsys):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert xmodal(_train_argv(scenes, straight, "--max-steps", "4")) == 0
    assert xmodal(_train_argv(scenes, halves, "--max-steps", "2", "--save-every", "2")) == 0
    capsys.readouterr()
    assert xmodal(_train_argv(scenes, halves, "--max-steps", "4")) == 1  # the run exists: --resume
    err = capsys.readouterr().err
    assert "--resume" in err and len(err.strip().splitlines()) == 1
    assert xmodal(_train_argv(scenes, halves, "--max-steps", "4", "--resume")) == 0
    assert sorted(p.name for p in (halves / "checkpoints").iterdir()) == ["step-2", "step-4"]

    a = load_file(straight / "last" / "model.safetensors")
    b = load_file(halves / "last" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [s for s, _ in _losses(halves)] == [1, 2, 3, 4]
    assert _losses(halves) == _losses(straight)


def _ray_run(data, out, **train):
    run = default_run("c4-small")
    task = {
        "images": str(data.images_dir),
        "annotations": str(data.detection["train"]),
        "detector": SMALL_TEST_SIZE,
        # Why this is exact and not only close: detectron2's Fast R-CNN losses are normalised by the
        # micro-batch's own RoI counts (class cross-entropy and box L1 by the sampled RoIs, the attribute
        # loss by the foreground RoIs with attributes), and DDP averages the workers' gradients. The
        # average of per-worker means is the global mean only when every image contributes as many RoIs,
        # so each image must fill its quotas: 8 RoIs of which 12.5% = 1 foreground, which the ground-truth
        # box (always a candidate) provides, and 7 background from hundreds of proposals. One object per
        # image with one attribute makes the attribute loss's count 1 per image too. The RPN's losses
        # divide by images x rpn_batch_size, a constant per image, whatever the sample holds.
        "training": {
            **SMALL_IMAGES,
            "roi_batch_size": 8,
            "roi_positive_fraction": 0.125,
            "rpn_batch_size": 32,
        },
    }
    # SGD (detectron2's optimizer): its step is linear in the gradient, so rounding-level differences in how
    # the workers' gradients are summed stay at rounding level; Adam divides by sqrt(v) and would turn the
    # rounding noise of a near-zero gradient into a full-size step
    base = {
        "max_steps": 2,
        "batch_size": 4,
        "lr": 0.005,
        "warmup_iters": 0,
        "loader_workers": 0,
        "optimizer": "sgd",
    }
    run = config_io.merge(run, {"task": task, "train": {**base, **train}})
    train_detector(run, out)
    return run, load_file(out / "last" / "model.safetensors")


@pytest.mark.slow
def test_two_ray_workers_reach_the_weights_of_one_process(single_objects, tmp_path, ray_two_cpus):
    """The same global batch of 4 as one micro-batch of 4 here or two of 2 on Ray Train workers: each image
    draws its scale, flip and samples from its own seed, so after 2 steps the weights agree to rounding."""
    run, alone = _ray_run(single_objects, tmp_path / "one_process")
    _, workers = _ray_run(single_objects, tmp_path / "two_workers", workers=2, cpus_per_worker=0.5)
    assert (tmp_path / "two_workers" / "checkpoints" / "step-2").is_dir()
    start = DetectionTask(run.task).build_model().state_dict()
    moved = max(float((alone[k] - start[k]).abs().max()) for k in alone if alone[k].is_floating_point())
    assert moved > 1e-3, "the steps must move the weights far beyond the tolerance"
    assert alone.keys() == workers.keys()
    for k in alone:
        torch.testing.assert_close(workers[k], alone[k], rtol=0, atol=1e-5, msg=k)
