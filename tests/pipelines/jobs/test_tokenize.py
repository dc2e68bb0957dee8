"""The tokenize job on the extraction pool: its store equals the dVAE on each image alone (as training reads
them), unreadable images go to the errors file, an interrupted run resumes to the same store, and a store
made with another dVAE is refused before Ray starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from model.dalle import DiscreteVAE, DVAEConfig
from pipelines.jobs.image_inputs import InputError
from pipelines.jobs.tokenize import TokenizeConfig, run_tokenize
from pipelines.jobs.tokenize_replica import TokenSink
from pipelines.tasks.generation import ImageFolder
from storage.token_store import TokenReader

N = 5


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance with 2 CPUs for the module (the job joins it and leaves it running)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Five readable images of several sizes (one greyscale) and one that is not an image."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(1)
    for i in range(N):
        shape = (20 + 3 * i, 16 + 5 * i, 3)
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(folder / f"img{i}.png")
    Image.fromarray(rng.integers(0, 256, (24, 24), dtype=np.uint8), mode="L").save(folder / "img1.png")
    (folder / "broken.png").write_bytes(b"not a png")
    return folder


def make_tokenizer(directory, seed: int = 0):
    torch.manual_seed(seed)
    cfg = DVAEConfig(image_size=16, downsample=4, hidden_size=8, codebook_size=7, blocks_per_group=1)
    return DiscreteVAE(cfg).save_pretrained(directory / "best")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    make_tokenizer(directory)
    return directory


def alone(tokenizer, images) -> dict[str, np.ndarray]:
    """Each readable image tokenized by itself, read as the dVAE's training reads it."""
    dvae = DiscreteVAE.from_pretrained(tokenizer / "best").eval()
    with torch.no_grad():
        return {
            f"img{i}": dvae.encode(ImageFolder([str(images / f"img{i}.png")], 16)[0][None])[0].numpy()
            for i in range(N)
        }


def config(images, tokenizer, out, **kw) -> TokenizeConfig:
    base = dict(workers=1, batch_size=2, progress=False, commit_seconds=0.2, max_failures=1)
    return TokenizeConfig(images=[str(images)], tokenizer=str(tokenizer), out=str(out), **{**base, **kw})


def stored(out) -> dict[str, np.ndarray]:
    reader = TokenReader(out)
    try:
        keys = list(reader.keys())
        return {k: reader[k] for k in keys}
    finally:
        reader.close()


@pytest.mark.slow
def test_the_job_equals_tokenizing_each_image_alone(ray_session, images, tokenizer, tmp_path):
    out = tmp_path / "tokens.lmdb"
    summary = run_tokenize(config(images, tokenizer, out))
    assert (summary.written, summary.skipped_present, summary.failed, summary.total) == (N, 0, 1, N + 1)
    assert summary.exit_code == 0  # one failure allowed
    expected, got = alone(tokenizer, images), stored(out)
    assert sorted(got) == sorted(expected)
    for img_id, grid in expected.items():
        np.testing.assert_array_equal(got[img_id], grid, err_msg=img_id)
    errors = [json.loads(line) for line in (tmp_path / "tokens.errors.jsonl").read_text().splitlines()]
    assert [e["img_id"] for e in errors] == ["broken"] and errors[0]["path"].endswith("broken.png")
    assert json.loads((tmp_path / "tokens.summary.json").read_text())["written"] == N


@pytest.mark.slow
def test_an_interrupted_run_resumes_to_the_same_store(ray_session, images, tokenizer, tmp_path, monkeypatch):
    out = tmp_path / "tokens.lmdb"
    take = TokenSink.take
    calls = []

    def interrupted(self, records):
        calls.append(len(records))
        if len(calls) == 2:  # Ctrl-C while the second batch comes back: the first is written
            raise KeyboardInterrupt
        return take(self, records)

    monkeypatch.setattr(TokenSink, "take", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_tokenize(config(images, tokenizer, out))
    monkeypatch.setattr(TokenSink, "take", take)
    before = stored(out)
    assert len(before) == calls[0] and 0 < len(before) < N

    summary = run_tokenize(config(images, tokenizer, out))
    assert (summary.written, summary.skipped_present, summary.failed) == (N - len(before), len(before), 1)
    expected, got = alone(tokenizer, images), stored(out)
    assert sorted(got) == sorted(expected)
    for img_id, grid in expected.items():
        np.testing.assert_array_equal(got[img_id], grid, err_msg=img_id)


def test_a_store_of_another_dvae_is_refused_before_ray_starts(images, tokenizer, tmp_path, monkeypatch):
    from pipelines.jobs import tokenize

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started before the refusal")

    other = tmp_path / "other"
    make_tokenizer(other, seed=1)
    out = tmp_path / "tokens.lmdb"
    from storage.token_store import TokenWriter

    TokenWriter(
        out, 4, 7, {"tokenizer": str(other), "tokenizer_sha256": tokenize.weights_sha256(other / "best")}
    ).close()
    monkeypatch.setattr(tokenize, "init_ray", no_ray)
    with pytest.raises(InputError, match="tokenized with another dVAE"):
        run_tokenize(config(images, tokenizer, out))
