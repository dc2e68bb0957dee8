"""Sampling from a DALL-E checkpoint: n images of the dVAE's size, reproducible by seed, and images decoded
from random tokens; bad settings and a missing checkpoint are one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from model.dalle import DalleConfig, DalleTransformer, DiscreteVAE, DVAEConfig
from pipelines.apps.generate.sample import SampleSettings, random_token_images, sample
from pipelines.cli import main
from pipelines.data.captions import Vocabulary
from pipelines.tasks.text_to_image import DVAE_DIR, VOCAB_FILE, TextToImageModel


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    vocab = Vocabulary(["a", "red", "circle"])
    dvae = DiscreteVAE(
        DVAEConfig(image_size=8, downsample=4, hidden_size=8, codebook_size=5, blocks_per_group=1)
    )
    cfg = DalleConfig(
        text_vocab_size=len(vocab),
        text_length=6,
        image_vocab_size=5,
        image_grid=2,
        num_layers=1,
        num_heads=2,
        hidden_size=16,
        conv_kernel=3,
    )
    directory = tmp_path / "run" / "best"
    DalleTransformer(cfg).save_pretrained(directory)
    vocab.save(directory / VOCAB_FILE)
    dvae.save_pretrained(directory / DVAE_DIR)
    return tmp_path / "run"


def test_samples_are_seeded_images_of_the_dvae_size(checkpoint):
    model = TextToImageModel.load(checkpoint)
    a = sample(model, "a red circle", SampleSettings(n=3, seed=1, top_p=None))
    b = sample(model, "a red circle", SampleSettings(n=3, seed=1, top_p=None))
    c = sample(model, "a red circle", SampleSettings(n=3, seed=2, top_p=None))
    assert len(a) == 3 and a[0].size == (8, 8) and a[0].mode == "RGB"
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, c, strict=True))
    assert len(random_token_images(model, 4, seed=0)) == 4


def test_sample_command_writes_pngs(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    args = [
        "generate",
        "sample",
        "a red circle",
        "--checkpoint",
        str(checkpoint),
        "--n",
        "2",
        "--out",
        str(out),
    ]
    assert main([*args, "--top-k", "3"]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == ["sample_000.png", "sample_001.png"]
    assert Image.open(out / "sample_000.png").size == (8, 8)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--top-p", "1.5"], "top_p=1.5 is out of range"),
        (["--n", "0"], "n=0"),
        (["--checkpoint", "nope"], "nope"),
    ],
)
def test_bad_settings_are_one_line(checkpoint, tmp_path, capsys, extra, message):
    args = ["generate", "sample", "x", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"), *extra]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_sample_contrastive_ranks_against_the_given_prompts(checkpoint, tmp_path, capsys):
    import json

    from pipelines.apps.generate.rerank import image_log_likelihood
    from pipelines.apps.generate.sample import sample_tokens

    out = tmp_path / "out"
    args = ["generate", "sample", "a red circle", "--checkpoint", str(checkpoint), "--n", "3",
            "--out", str(out), "--top-p", "1", "--rerank", "contrastive"]  # fmt: skip
    assert main(args) == 1
    assert "needs other prompts" in capsys.readouterr().err
    assert main([*args, "--contrast", "a circle", "--contrast", "red"]) == 0
    ranking = json.loads((out / "ranking.json").read_text())
    assert ranking["reranker"] == "contrastive"
    model = TextToImageModel.load(checkpoint)
    tokens = sample_tokens(model, "a red circle", SampleSettings(n=3, top_p=1.0, seed=0))
    own = image_log_likelihood(model, "a red circle", tokens)
    others = (
        image_log_likelihood(model, "a circle", tokens) + image_log_likelihood(model, "red", tokens)
    ) / 2
    expected = (own - others).tolist()
    assert [c["sample"] for c in ranking["candidates"]] == sorted(range(3), key=lambda i: -expected[i])
    np.testing.assert_allclose(
        [c["score"] for c in ranking["candidates"]], sorted(expected, reverse=True), rtol=1e-5
    )


def test_a_prompt_longer_than_the_model_reads_is_said(checkpoint, tmp_path, capsys):
    read = TextToImageModel.load(checkpoint).transformer.config.text_length - 2
    base = ["generate", "sample", "--checkpoint", str(checkpoint), "--n", "1", "--out", str(tmp_path / "o")]
    assert main([*base, " ".join(["red"] * read)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main([*base, " ".join(["red"] * (read + 5))]) == 0
    err = capsys.readouterr().err.strip()
    assert f"reads the prompt's first {read} of its {read + 5} words" in err and len(err.splitlines()) == 1


def test_a_prompt_without_a_known_word_is_refused_naming_it(checkpoint, tmp_path, capsys):
    base = ["generate", "sample", "--checkpoint", str(checkpoint), "--n", "1", "--out", str(tmp_path / "o")]
    assert main([*base, "Zebra tulip!"]) == 1
    err = capsys.readouterr().err
    assert (
        "no word of the prompt 'Zebra tulip!' is in the model's vocabulary of 7 words (e.g. a, red, circle)"
        in err
    )
    assert not (tmp_path / "o").exists()
    assert main([*base, "a red zebra"]) == 0
    err = capsys.readouterr().err.strip()
    assert err == "xmodal generate sample: warning: the model does not know 'zebra': read as <unk>"
