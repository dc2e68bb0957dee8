"""Re-ranking DALL-E's candidates by a fine-tuned captioner: the order is the captioner's log-likelihood of
the prompt on each candidate's detected regions, computed here step by step; the commands say which
re-ranker ranked and refuse a captioner re-ranking without a captioner in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from extraction.config import SMALL_PRESET
from pipelines.apps.generate.rerank import rank, rerank_scores
from pipelines.apps.generate.rerank_captioner import CaptionerReranker
from pipelines.apps.generate.sample import SampleSettings, decode, sample_tokens
from pipelines.cli import main
from pipelines.tasks.finetune import FinetuneConfig
from pipelines.tasks.finetuned import build_task
from pipelines.tasks.text_to_image import TextToImageModel
from storage import FeatureWriter, RegionFeatures

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "a red circle"
BOXES = 4


@pytest.fixture(scope="module")
def captioner_run(tmp_path_factory, detector_dir):
    """A tiny Up-Down captioning directory over the detector's 256-d regions, as `CaptionTask.save` writes."""
    root = tmp_path_factory.mktemp("caption")
    rng = np.random.default_rng(0)
    provenance = {
        "preset": SMALL_PRESET, "selection": "caffe", "min_boxes": BOXES, "max_boxes": BOXES,
        "config": {"min_size": 64, "max_size": 96, "post_nms_topk": 20}, "weights": str(detector_dir),
    }  # fmt: skip
    with FeatureWriter(root / "feats.lmdb", feature_dim=256, max_boxes=BOXES, meta=provenance) as w:
        for i in range(2):
            boxes = np.tile(np.array([[0, 0, 8, 8]], np.float32), (BOXES, 1))
            ones, ids = np.ones(BOXES, np.float32), np.zeros(BOXES, np.int64)
            feats = rng.random((BOXES, 256), dtype=np.float32)
            w.put(RegionFeatures(f"img{i}", 16, 16, boxes, feats, ids, ones, ids, ones))
    images = [
        {"filename": f"img{i}.jpg", "split": "train", "cocoid": i,
         "sentences": [{"tokens": ["a", "red", "circle", "and", "a", "blue", "square"]}]}
        for i in range(2)
    ]  # fmt: skip
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))
    cfg = FinetuneConfig(
        task="caption",
        arch="updown",
        features=[str(root / "feats.lmdb")],
        train_files=[str(root / "dataset_coco.json")],
        preset="tiny",
        model={"visual_feat_dim": 256},
        vocab_min_count=1,
    )
    task = build_task(cfg)
    torch.manual_seed(0)
    task.save(task.build_model(), root / "best")
    return root / "best"


def stepwise_log_likelihood(model, vocab, words: list[str], regions: RegionFeatures) -> float:
    """log p(<bos> words <eos> | regions), one decoding step at a time (not the teacher-forced forward)."""
    ids = [vocab.bos_id, *(vocab.index.get(w, vocab.unk_id) for w in words), vocab.eos_id]
    feats = torch.from_numpy(np.asarray(regions.features, np.float32))[None]
    ctx = model.encode(feats)
    state = model.init_state(ctx)
    total = 0.0
    for prev, nxt in zip(ids[:-1], ids[1:], strict=True):
        out = model.step(torch.tensor([prev]), state, ctx)
        state = out.state
        total += float(F.log_softmax(out.logits[0].double(), -1)[nxt])
    return total


@torch.no_grad()
def test_order_is_the_captioners_likelihood_of_the_prompt(dalle_run, captioner_run, detector_dir):
    model = TextToImageModel.load(dalle_run)
    judge = CaptionerReranker.load(captioner_run, detector_dir)
    tokens = sample_tokens(model, PROMPT, SampleSettings(n=5, seed=0, top_p=None))
    scores = rerank_scores(model, PROMPT, tokens, "captioner", judge=judge)

    images = decode(model, tokens)
    regions = judge.regions(images)
    assert all(r.num_boxes == BOXES for r in regions)
    expected = [
        stepwise_log_likelihood(judge.tuned.model, judge.tuned.tokenizer, PROMPT.split(), r) for r in regions
    ]
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-4, atol=1e-4)
    assert len(set(np.round(expected, 4))) > 1  # the candidates differ, so the order is a real test
    assert rank(scores) == sorted(range(len(expected)), key=lambda i: -expected[i])
    assert "updown" in judge.source


def test_sample_command_writes_best_first_and_names_the_reranker(
    dalle_run, captioner_run, detector_dir, tmp_path, capsys
):
    out = tmp_path / "out"
    argv = ["generate", "sample", PROMPT, "--checkpoint", str(dalle_run), "--n", "3", "--out", str(out),
            "--rerank", "captioner", "--captioner", str(captioner_run),
            "--captioner-detector", str(detector_dir)]  # fmt: skip
    assert main(argv) == 0
    assert "captioner updown" in capsys.readouterr().out
    ranking = json.loads((out / "ranking.json").read_text())
    assert ranking["reranker"].startswith("captioner updown")
    scores = [c["score"] for c in ranking["candidates"]]
    assert scores == sorted(scores, reverse=True)
    assert [c["file"] for c in ranking["candidates"]] == [f"sample_{i:03d}.png" for i in range(3)]
    assert sorted(c["sample"] for c in ranking["candidates"]) == [0, 1, 2]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rerank", "captioner"], "needs --captioner"),
        (["--captioner", "somewhere"], "go with --rerank captioner"),
        (["--rerank", "captioner", "--captioner", "nope"], "nope"),
    ],
)
def test_captioner_rerank_errors_are_one_line(dalle_run, tmp_path, capsys, extra, message):
    argv = [
        "generate",
        "sample",
        PROMPT,
        "--checkpoint",
        str(dalle_run),
        "--out",
        str(tmp_path / "o"),
        *extra,
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_dalle_run_as_captioner_is_refused_naming_the_flag(dalle_run, tmp_path, capsys):
    argv = ["generate", "sample", PROMPT, "--checkpoint", str(dalle_run), "--out", str(tmp_path / "o"),
            "--rerank", "captioner", "--captioner", str(dalle_run)]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "--captioner: " in err and "finetune.json not found" in err and len(err.splitlines()) == 1


def test_evaluate_reports_the_captioner_it_reranked_with(
    dalle_run, captioner_run, detector_dir, tmp_path, capsys
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\na blue square\n")
    argv = ["generate", "evaluate", "--checkpoint", str(dalle_run), "--detector", str(detector_dir),
            "--prompts", str(prompts), "--n", "2", "--rerank", "captioner", "--captioner", str(captioner_run),
            "--captioner-detector", str(detector_dir), "--json"]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rerank"] == "captioner"
    assert result["reranker"] == f"captioner updown {captioner_run.resolve()}"
