"""`xmodal generate train-tokenizer`: trains from an image folder into a run whose best/ is a dVAE
directory, and refuses a missing folder in one line."""

from __future__ import annotations

import numpy as np
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
