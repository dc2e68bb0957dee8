"""DALL-E's transformer task on the engine: pairs come from the captions file and the token store, the
checkpoint is self-contained, a resumed run ends exactly where an uninterrupted one does, and a store made by
another tokenizer is refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from model.dalle import DiscreteVAE, DVAEConfig
from pipelines.engine.launch import fit
from pipelines.engine.trainer import TrainConfig
from pipelines.tasks.text_to_image import TextToImageModel, TextToImageTask, TextToImageTaskConfig
from storage.token_store import TokenWriter

TINY_DALLE = {"num_layers": 1, "num_heads": 2, "hidden_size": 16, "text_length": 8, "conv_kernel": 3}


@pytest.fixture
def data(tmp_path):
    torch.manual_seed(0)
    cfg = DVAEConfig(image_size=8, downsample=4, hidden_size=8, codebook_size=5, blocks_per_group=1)
    DiscreteVAE(cfg).save_pretrained(tmp_path / "tok" / "best")
    rng = np.random.default_rng(0)
    words = ["red circle", "blue square", "green triangle"]
    rows = []
    with TokenWriter(tmp_path / "store", grid=2, codebook_size=5) as w:
        for i in range(8):
            w.put(f"im{i}", rng.integers(0, 5, (2, 2)))
            split = "val" if i >= 6 else "train"
            sentences = [{"raw": f"a {words[i % 3]}"}, {"raw": f"one {words[i % 3]} here"}]
            rows.append({"filename": f"im{i}.png", "cocoid": i, "split": split, "sentences": sentences})
    rows.append({"filename": "missing.png", "cocoid": 99, "split": "train", "sentences": [{"raw": "x"}]})
    (tmp_path / "captions.json").write_text(json.dumps({"images": rows}))
    return tmp_path


def _task(d, **kw) -> TextToImageTask:
    return TextToImageTask(
        TextToImageTaskConfig(
            features=str(d / "store"),
            captions=str(d / "captions.json"),
            tokenizer=str(d / "tok"),
            dalle=TINY_DALLE,
            **kw,
        )
    )


def _train(max_steps: int) -> TrainConfig:
    return TrainConfig(
        lr=1e-2, batch_size=4, max_steps=max_steps, trackers=[], loader_workers=0, save_every=2
    )


def test_pairs_and_shapes(data):
    task = _task(data)
    assert len(task.train_dataset()) == 12 and len(task.valid_dataset()) == 4  # the missing image is left out
    cfg = task.dalle_config
    assert (cfg.image_grid, cfg.image_vocab_size, cfg.text_vocab_size) == (2, 5, len(task.vocab))
    batch = task.collate([task.train_dataset()[i] for i in range(3)], np.random.default_rng(0))
    assert batch["text"].shape == (3, 8) and batch["image"].shape == (3, 4)
    # "<bos> a red circle <eos>" then padding
    assert batch["padding"][0].tolist() == [False] * 5 + [True] * 3
    assert task.vocab.decode(batch["text"][0].tolist()) == "a red circle"


@pytest.mark.slow  # three engine runs: about a minute on a busy 2-core machine
def test_resumed_run_matches_an_uninterrupted_one_and_checkpoint_loads(data, tmp_path):
    torch.set_num_threads(1)
    fit(_task(data), _train(4), tmp_path / "straight")
    fit(_task(data), _train(4), tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "step-4")
    shutil.rmtree(tmp_path / "split" / "last")
    fit(_task(data), _train(4), tmp_path / "split", resume=True)
    straight = TextToImageModel.load(tmp_path / "straight" / "last")
    resumed = TextToImageModel.load(tmp_path / "split" / "last")
    a, b = straight.transformer.state_dict(), resumed.transformer.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight.vocab.words == resumed.vocab.words and straight.dvae.config.codebook_size == 5
    metrics = [
        json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
    ]
    assert any("valid_image_log_likelihood" in m for m in metrics)


def test_a_store_from_another_tokenizer_is_refused(data):
    cfg = DVAEConfig(image_size=8, downsample=4, hidden_size=8, codebook_size=6, blocks_per_group=1)
    DiscreteVAE(cfg).save_pretrained(data / "tok" / "best")
    with pytest.raises(ValueError, match="tokenize with it"):
        _task(data)


def test_evaluation_scores_the_images_after_other_captions_too(data):
    from pipelines.tasks.text_to_image import PRIMARY_METRIC, SHUFFLED_METRIC

    torch.manual_seed(0)
    task = _task(data)
    model = task.build_model().eval()
    valid = task.valid_dataset()
    batch = task.collate([valid[i] for i in range(len(valid))], np.random.default_rng(0))
    metrics = task.evaluate(model, [batch])
    text = model.pad_text(batch["text"], batch["padding"])
    wrong = torch.cat([text[-1:], text[:-1]])  # image i after caption i - 1
    with torch.no_grad():
        logits = model(wrong, batch["image"]).image_logits
    by_hand = -torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["image"].flatten())
    assert metrics[SHUFFLED_METRIC] == pytest.approx(float(by_hand), rel=1e-5)
    assert metrics[PRIMARY_METRIC] != pytest.approx(metrics[SHUFFLED_METRIC], rel=1e-9)


def test_caption_dropout_empties_the_drawn_training_captions_only(data):
    task = _task(data, caption_dropout=0.5)
    train = task.train_dataset()
    items = [train[i] for i in range(12)]
    batch = task.collate(items, np.random.default_rng(3))
    dropped = np.random.default_rng(3).random(12) < 0.5  # the collate's draw, made independently
    assert 0 < dropped.sum() < 12
    plain = _task(data).collate([train[i][:3] + (0.0,) for i in range(12)], np.random.default_rng(3))
    for row in range(12):
        if dropped[row]:  # "<bos> <eos>" then padding
            assert task.vocab.decode(batch["text"][row].tolist()) == ""
            assert batch["padding"][row].tolist() == [False, False] + [True] * 6
        else:
            assert torch.equal(batch["text"][row], plain["text"][row])
            assert torch.equal(batch["padding"][row], plain["padding"][row])
    assert torch.equal(batch["image"], plain["image"])  # images always kept
    # validation pairs keep their captions whatever the draw
    valid = task.valid_dataset()
    kept = task.collate([valid[i] for i in range(len(valid))], np.random.default_rng(3))
    assert all(task.vocab.decode(t.tolist()) for t in kept["text"])


def test_caption_dropout_of_one_is_a_one_line_error(data, capsys):
    from pipelines.cli import main

    args = ["generate", "train", "--features", str(data / "store"), "--captions",
            str(data / "captions.json"), "--tokenizer", str(data / "tok"), "--out", str(data / "run"),
            "--caption-dropout", "1"]  # fmt: skip
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert "caption_dropout" in err and len(err.splitlines()) == 1
    assert not (data / "run" / "checkpoints").exists()
