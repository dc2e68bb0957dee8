"""A 14x14 grid store of the demo's generated scenes read unchanged by the commands made for regions:
Show-Attend-Tell with hard attention trains and captions over its 196 cells (`evaluate caption` on a
grid store: tests/benchmarks/bench_caption_grid.py), and VQA fine-tunes,
evaluates and answers `ask` on it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from extraction import Detector
from extraction.config import SMALL_PRESET
from pipelines.apps.ask import ask, build_detector
from pipelines.apps.caption import caption_regions
from pipelines.apps.demo.synthetic import SyntheticConfig, generate
from pipelines.cli import main
from pipelines.engine.run_log import read_metrics
from pipelines.tasks.finetuned import load_finetuned
from storage import FeatureReader, FeatureWriter

pytestmark = pytest.mark.usefixtures("one_thread")
CELLS = 14 * 14


@pytest.fixture(scope="module")
def grid_scenes(tmp_path_factory) -> dict:
    """30 generated scenes and their 14x14 grid store from the small detector (random weights), written
    as `extract --features grid` writes it: the detector's records and provenance."""
    root = tmp_path_factory.mktemp("grid_scenes")
    data = generate(root / "data", SyntheticConfig(num_images=30, seed=0, max_shapes=2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        det = Detector.build(SMALL_PRESET, grid="14x14")
    paths = sorted(data.images_dir.glob("*.png"))
    store = root / "grid.lmdb"
    with FeatureWriter(store, feature_dim=det.feature_dim, max_boxes=CELLS, meta=det.provenance()) as writer:
        for start in range(0, len(paths), 8):
            chunk = paths[start : start + 8]
            for record in det.detect([cv2.imread(str(p)) for p in chunk], [p.stem for p in chunk]):
                writer.put(record)
    return {"data": data, "store": store, "detector": det, "root": root}


@pytest.mark.slow
def test_hard_attention_trains_and_captions_over_the_grid_cells(grid_scenes, tmp_path):
    data, store = grid_scenes["data"], grid_scenes["store"]
    split, out = str(data.captions), tmp_path / "sat-hard"
    argv = ["finetune", "caption", "--arch", "sat-hard", "--features", str(store),
            "--train", f"{split}:train", "--valid", f"{split}:val", "--out", str(out), "--seed", "0",
            "--batch-size", "8", "--max-steps", "4", "--lr", "2e-3", "task.preset=tiny",
            "task.vocab_min_count=1", "task.max_length=20",
            # every batch samples one cell per word (REINFORCE), none takes the expected context
            "task.model.expected_attention_prob=0.0",
            "train.loader_workers=0", "train.log_every=1", "train.eval_every=4"]  # fmt: skip
    assert main(argv) == 0
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 4 and all(np.isfinite(losses))

    tuned = load_finetuned(out / "last")
    model = tuned.model
    assert type(model).__name__ == "HardAttentionCaptioner"
    assert model.config.visual_feat_dim == grid_scenes["detector"].feature_dim  # read from the store
    # the REINFORCE path ran: its moving baseline of log p(caption) was started and moved off zero
    assert bool(model.baseline_started) and float(model.baseline) < 0.0
    assert tuned.settings["detector"]["features"] == "grid" and tuned.settings["detector"]["grid"] == "14x14"

    reader = FeatureReader(store)
    try:
        record = reader[list(reader.keys())[0]]
    finally:
        reader.close()
    assert record.num_boxes == CELLS

    result = caption_regions(tuned, record, beam_size=2)
    assert result.attentions.shape == (len(result.words), CELLS)
    np.testing.assert_allclose(result.attentions.sum(axis=1), 1.0, rtol=1e-4)


def test_hard_attention_samples_a_grid_cell_with_its_probability(grid_scenes):
    """One REINFORCE step over real grid cells: each sampled location is a cell index, its context is that
    cell's (gated) feature, and log p(s) is log α at that cell."""
    from model.captioning import CaptionConfig
    from model.captioning.show_attend_tell import HardAttentionCaptioner

    reader = FeatureReader(grid_scenes["store"])
    try:
        batch = reader.read_batch(list(reader.keys())[:3])
    finally:
        reader.close()
    feats = torch.from_numpy(np.asarray(batch.features, dtype=np.float32))
    mask = torch.ones(feats.shape[:2], dtype=torch.bool)
    assert feats.shape[1] == CELLS
    torch.manual_seed(0)
    cfg = CaptionConfig(
        **{**CaptionConfig.PRESETS["tiny"], "vocab_size": 12, "visual_feat_dim": feats.shape[-1]}
    )
    model = HardAttentionCaptioner(cfg).eval()
    ctx = model.encode(feats, mask)
    h, _ = model.init_state(ctx)
    torch.manual_seed(1)
    alpha, z, log_p = model._attend(h, ctx, sample=True)
    torch.manual_seed(1)
    location = torch.multinomial(alpha, 1).squeeze(1)  # the same draw, made here
    assert alpha.shape == (3, CELLS) and ((location >= 0) & (location < CELLS)).all()
    gate = torch.sigmoid(model.gate(h))
    want = gate * ctx.features[torch.arange(3), location]
    torch.testing.assert_close(z, want)
    torch.testing.assert_close(log_p, torch.log(alpha[torch.arange(3), location]))


@pytest.mark.slow
def test_vqa_fine_tunes_evaluates_and_asks_on_the_grid_store(grid_scenes, tmp_path):
    data, store = grid_scenes["data"], grid_scenes["store"]
    out = tmp_path / "vqa"
    argv = ["finetune", "vqa", "--features", str(store), "--train", str(data.vqa["train"]),
            "--valid", str(data.vqa["valid"]), "--vocab", str(data.vocab), "--preset", "tiny",
            "--out", str(out), "--seed", "0", "--max-steps", "6", "--batch-size", "16", "--lr", "1e-3",
            "train.loader_workers=0", "train.log_every=1", "train.eval_every=6"]  # fmt: skip
    assert main(argv) == 0
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 6 and all(np.isfinite(losses))

    preds = tmp_path / "preds.json"
    argv = ["evaluate", "vqa", "--checkpoint", str(out / "last"), "--features", str(store),
            "--split", str(data.vqa["test"]), "--out", str(preds)]  # fmt: skip
    assert main(argv) == 0
    questions = json.loads(data.vqa["test"].read_text())
    assert {p["question_id"] for p in json.loads(preds.read_text())} == {q["question_id"] for q in questions}

    # `ask` rebuilds the grid extractor from the run's record and attends over the new image's 196 cells
    tuned = load_finetuned(out / "last")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        det = build_detector(tuned)
    assert det.grid is not None and det.grid.spec == "14x14"
    row = questions[0]
    image = cv2.imread(str(Path(data.images_dir) / f"{row['img_id']}.png"))
    regions = det.detect([image], [row["img_id"]])[0]
    reader = FeatureReader(store)
    try:
        stored = reader[row["img_id"]].features
    finally:
        reader.close()
    # the same cells (float16 in the store; the thread count may move a float32 sum's last bit)
    np.testing.assert_allclose(regions.features, stored.astype(np.float32), rtol=2e-3, atol=1e-3)
    result = ask(tuned, regions, row["sent"], top_k=3)
    assert len(result.answers) == 3 and result.attention.shape == (CELLS,)


@pytest.mark.slow
def test_pretraining_masks_grid_cells_with_their_detector_labels_as_targets(grid_scenes, tmp_path):
    """Masked-region modelling on a grid store: the cells' box-predictor classes and attributes are the
    masked-object targets, and every pre-training loss is computed on them."""
    data, store = grid_scenes["data"], grid_scenes["store"]
    out = tmp_path / "pretrain"
    argv = ["pretrain", "--features", str(store), "--train", str(data.pretrain["train"]),
            "--valid", str(data.pretrain["valid"]), "--vocab", str(data.vocab), "--preset", "tiny",
            "--out", str(out), "--seed", "0", "--max-steps", "3", "--batch-size", "8",
            "train.loader_workers=0", "train.log_every=1", "train.eval_every=3"]  # fmt: skip
    assert main(argv) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 3
    for row in rows:  # masked cells regress their feature and predict their detector class and attribute
        for loss in ("mlm", "matched", "obj", "attr", "feat"):
            assert np.isfinite(row[loss]) and row[loss] > 0.0, (loss, row)
