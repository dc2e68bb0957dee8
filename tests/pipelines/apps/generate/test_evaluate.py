"""`xmodal generate evaluate` and the re-rankers: the likelihood matches the transformer's own loss, the
contrastive score is PMI against other prompts, the evaluation's accuracies are those of its detector on
its samples, and bad input is one line."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from extraction.config import PRESETS, SMALL_PRESET
from extraction.rcnn import VGFasterRCNN, init_random_weights
from extraction.weights import save_detector_dir
from model.dalle import DalleConfig, DalleTransformer, DiscreteVAE, DVAEConfig
from pipelines.apps.demo.synthetic import COLOURS, SHAPES
from pipelines.apps.generate.evaluate import EvalSettings, detect, detections, evaluate, load_detector
from pipelines.apps.generate.rerank import image_log_likelihood, rerank_scores
from pipelines.apps.generate.sample import SampleSettings, decode, prompt_text, sample_tokens
from pipelines.cli import main
from pipelines.data.captions import Vocabulary
from pipelines.scoring.prompt_accuracy import prompt_targets, satisfies
from pipelines.tasks.text_to_image import DVAE_DIR, VOCAB_FILE, TextToImageModel
from storage.records import RegionFeatures

WORDS = ["a", "small", "large", *COLOURS, *SHAPES, "at", "the", "top", "left", "and"]
PROMPTS = [
    "a red circle at the top left",
    "a large blue square",
    "two shapes",
    "a green triangle and a red square",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    vocab = Vocabulary(WORDS)
    dvae = DiscreteVAE(
        DVAEConfig(image_size=16, downsample=4, hidden_size=8, codebook_size=7, blocks_per_group=1)
    )
    cfg = DalleConfig(
        text_vocab_size=len(vocab),
        text_length=12,
        image_vocab_size=7,
        image_grid=4,
        num_layers=1,
        num_heads=2,
        hidden_size=16,
        conv_kernel=3,
    )
    directory = tmp_path_factory.mktemp("run") / "best"
    DalleTransformer(cfg).save_pretrained(directory)
    vocab.save(directory / VOCAB_FILE)
    dvae.save_pretrained(directory / DVAE_DIR)
    return directory.parent


@pytest.fixture(scope="module")
def detector_dir(tmp_path_factory):
    """A c4-small detector (random weights) whose classes are the demo's shapes and attributes its colours."""
    torch.set_num_threads(2)
    config = dataclasses.replace(PRESETS[SMALL_PRESET], min_size=64, max_size=96, post_nms_topk=20)
    model = VGFasterRCNN(config)
    init_random_weights(model, 3)
    directory = tmp_path_factory.mktemp("det") / "best"
    save_detector_dir(model.eval(), config, SMALL_PRESET, list(SHAPES), list(COLOURS), directory)
    return directory


def test_likelihood_is_the_transformers_own_image_loss(checkpoint):
    model = TextToImageModel.load(checkpoint)
    tokens = sample_tokens(model, PROMPTS[0], SampleSettings(n=3, seed=0, top_p=None))
    ours = image_log_likelihood(model, PROMPTS[0], tokens)
    text = prompt_text(model, PROMPTS[0])
    with torch.no_grad():  # the loss averages cross-entropy over the 16 tokens of one row
        reference = [-16 * model.transformer.loss(text, row[None]).image for row in tokens]
    torch.testing.assert_close(ours, torch.stack(reference), rtol=1e-5, atol=1e-4)
    pmi = rerank_scores(model, PROMPTS[0], tokens, "contrastive", PROMPTS[1:3])
    others = (
        image_log_likelihood(model, PROMPTS[1], tokens) + image_log_likelihood(model, PROMPTS[2], tokens)
    ) / 2
    torch.testing.assert_close(pmi, ours - others)
    assert torch.equal(rerank_scores(model, PROMPTS[0], tokens, "none"), torch.zeros(3))
    with pytest.raises(ValueError, match="other prompts"):
        rerank_scores(model, PROMPTS[0], tokens, "contrastive")


def test_detections_carry_the_detectors_names():
    record = RegionFeatures(
        img_id="x",
        img_h=8,
        img_w=8,
        boxes=np.zeros((2, 4), np.float32),
        features=np.zeros((2, 3), np.float32),
        objects_id=np.array([2, 0]),
        objects_conf=np.array([0.9, 0.6], np.float32),
        attrs_id=np.array([1, 3]),
        attrs_conf=np.array([0.8, 0.7], np.float32),
    )
    found = detections(record, list(SHAPES), list(COLOURS))
    assert [(d.shape, d.colour) for d in found] == [("triangle", "green"), ("circle", "yellow")]
    assert found[0].score == pytest.approx(0.9)


def test_evaluate_scores_its_own_samples_with_the_detector(checkpoint, detector_dir):
    # threshold 0: the random detector's boxes all count, so accuracies are far from 0 and comparable
    settings = EvalSettings(SampleSettings(n=2, seed=5, top_p=None), rerank="none", threshold=0.0)
    model, detector = TextToImageModel.load(checkpoint), load_detector(detector_dir, settings)
    result = evaluate(model, detector, PROMPTS, settings)
    assert result["prompts"] == 3 and result["prompts_left_out"] == 1  # "two shapes" names no colour
    kept = [p for p in PROMPTS if prompt_targets(p, SHAPES, list(COLOURS))]
    hits = []
    for i, prompt in enumerate(kept):  # the same draws (seed + i) and detections, scored here
        images = decode(model, sample_tokens(model, prompt, SampleSettings(n=2, seed=5 + i, top_p=None)))
        wanted = prompt_targets(prompt, SHAPES, list(COLOURS))
        hits += [satisfies(d, wanted, 0.0) for d in detect(detector, images)]
    assert result["sample_accuracy"] == pytest.approx(np.mean(hits))
    assert result["prompt_accuracy"] == pytest.approx(np.mean(hits[::2]))  # no re-ranking: the first
    pairs = np.array(hits).reshape(len(kept), 2)
    assert result["best_of_n_accuracy"] == pytest.approx(pairs.any(axis=1).mean())  # a perfect re-ranker
    assert 0 <= result["random_token_accuracy"] <= 1 and 0 <= result["other_prompt_accuracy"] <= 1


def test_evaluate_command_prints_the_issue_keys(checkpoint, detector_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    args = ["generate", "evaluate", "--checkpoint", str(checkpoint), "--detector", str(detector_dir)]
    assert main([*args, "--prompts", str(prompts), "--n", "2", "--json", "--rerank", "contrastive"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"prompt_accuracy", "random_token_accuracy"} <= result.keys() and result["rerank"] == "contrastive"
    # what to provide: the weights (and, without the `fid` extra, torch-fidelity itself)
    assert result["fid"] is None and "--fid-weights PATH" in result["fid_skipped"]


@pytest.mark.parametrize(
    ("case", "message"),
    [("no-prompts", "prompts.txt"), ("empty", "no prompts"), ("no-detector", "not a detector directory")],
)
def test_bad_input_is_one_line(checkpoint, detector_dir, tmp_path, capsys, case, message):
    prompts = tmp_path / "prompts.txt"
    if case != "no-prompts":
        prompts.write_text("\n\n" if case == "empty" else "a red circle\n")
    detector = tmp_path / "nothing" if case == "no-detector" else detector_dir
    args = ["generate", "evaluate", "--checkpoint", str(checkpoint), "--detector", str(detector)]
    assert main([*args, "--prompts", str(prompts)]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
