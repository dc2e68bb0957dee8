"""`xmodal generate train-tokenizer`: trains from an image folder into a run whose best/ is a dVAE
directory, and refuses a missing folder in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from model.dalle import DiscreteVAE
from pipelines.cli import main


def test_train_tokenizer_writes_a_loadable_dvae(tmp_path, capsys):
    rng = np.random.default_rng(0)
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    overrides = [
        "task.dvae.image_size=16",
        "task.dvae.downsample=4",
        "task.dvae.hidden_size=8",
        "task.dvae.codebook_size=7",
        "task.valid_every=3",
        "train.eval_every=2",
        "train.loader_workers=0",
    ]
    args = ["generate", "train-tokenizer", "--images", str(folder), "--out", str(tmp_path / "run")]
    assert main([*args, "--max-steps", "2", "--batch-size", "2", *overrides]) == 0
    assert "best PSNR" in capsys.readouterr().out
    dvae = DiscreteVAE.from_pretrained(tmp_path / "run" / "best")
    assert dvae.config.codebook_size == 7 and dvae.config.image_size == 16


def test_missing_image_folder_is_one_line(tmp_path, capsys):
    args = ["generate", "train-tokenizer", "--images", str(tmp_path / "nope"), "--out", str(tmp_path / "run")]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("xmodal generate train-tokenizer:") and "does not exist" in err
    assert len(err.splitlines()) == 1


def _tiny_dvae(tmp_path):
    from model.dalle import DVAEConfig

    torch.manual_seed(0)
    cfg = DVAEConfig(image_size=16, downsample=4, hidden_size=8, codebook_size=7, blocks_per_group=1)
    return DiscreteVAE(cfg).save_pretrained(tmp_path / "tok" / "best")


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray instance with 2 CPUs that both tokenize runs join (each start costs seconds)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_tokenize_writes_the_dvae_grids_and_resumes(ray_session, tmp_path, capsys):
    from pipelines.tasks.generation import ImageFolder
    from storage.token_store import TokenReader

    rng = np.random.default_rng(1)
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (20, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    (folder / "bad.png").write_bytes(b"not a png")
    _tiny_dvae(tmp_path)
    args = ["generate", "tokenize", "--images", str(folder), "--tokenizer", str(tmp_path / "tok")]
    # like `xmodal extract`: every readable image is stored, then exit status 2 (more than --max-failures)
    assert main([*args, "--out", str(tmp_path / "store"), "--batch-size", "2", "--no-progress"]) == 2
    assert "3 token grids written, 0 already stored, 1 unreadable" in capsys.readouterr().out
    errors = [json.loads(line) for line in (tmp_path / "store.errors.jsonl").read_text().splitlines()]
    assert [e["img_id"] for e in errors] == ["bad"]
    dvae = DiscreteVAE.from_pretrained(tmp_path / "tok" / "best")
    reader = TokenReader(tmp_path / "store")
    assert len(reader) == 3 and reader.grid == 4 and reader.codebook_size == 7
    expected = dvae.encode(ImageFolder([str(folder / "1.png")], 16)[0][None])[0].numpy()
    np.testing.assert_array_equal(reader["1"], expected)
    reader.close()
    assert main([*args, "--out", str(tmp_path / "store"), "--max-failures", "1", "--no-progress"]) == 0
    assert "0 token grids written, 3 already stored" in capsys.readouterr().out


def test_tokenize_refuses_a_region_store_as_out(tmp_path, capsys):
    from storage import FeatureWriter

    FeatureWriter(tmp_path / "regions", feature_dim=4).close()
    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "a.png")
    _tiny_dvae(tmp_path)
    args = [
        "generate",
        "tokenize",
        "--images",
        str(tmp_path / "images"),
        "--tokenizer",
        str(tmp_path / "tok"),
    ]
    assert main([*args, "--out", str(tmp_path / "regions")]) == 1
    err = capsys.readouterr().err.strip()
    assert "xmodal-region-features" in err and len(err.splitlines()) == 1
