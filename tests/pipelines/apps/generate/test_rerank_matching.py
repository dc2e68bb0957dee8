"""Re-ranking DALL-E's candidates by a retrieval-tuned LXMERT's matching head: the order is the head's score
of (prompt, each candidate's regions), each pair scored alone here; the command names the matcher."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.apps.generate.rerank import rank, rerank_scores
from pipelines.apps.generate.rerank_matching import MatchingReranker
from pipelines.apps.generate.sample import SampleSettings, decode, sample_tokens
from pipelines.cli import main
from pipelines.data.regions import image_sizes, inputs_for, pad_regions, region_arrays
from pipelines.data.text import encode_text, pad_text
from pipelines.tasks.finetune import FinetuneConfig
from pipelines.tasks.finetuned import build_task
from pipelines.tasks.text_to_image import TextToImageModel
from storage import FeatureWriter, RegionFeatures

from .test_rerank_captioner import BOXES, PROMPT

pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "blue", "circle", "square", "and"]


@pytest.fixture(scope="module")
def matcher_run(tmp_path_factory, detector_dir):
    """A tiny LXMERT retrieval directory over the detector's 256-d regions, as the task's `save` writes."""
    from extraction.config import SMALL_PRESET

    root = tmp_path_factory.mktemp("matcher")
    rng = np.random.default_rng(0)
    provenance = {
        "preset": SMALL_PRESET, "selection": "caffe", "min_boxes": BOXES, "max_boxes": BOXES,
        "config": {"min_size": 64, "max_size": 96, "post_nms_topk": 20}, "weights": str(detector_dir),
    }  # fmt: skip
    with FeatureWriter(root / "feats.lmdb", feature_dim=256, max_boxes=BOXES, meta=provenance) as w:
        for i in range(2):
            boxes = np.tile(np.array([[0, 0, 8, 8]], np.float32), (BOXES, 1))
            ones, ids = np.ones(BOXES, np.float32), np.zeros(BOXES, np.int64)
            w.put(RegionFeatures(f"img{i}", 16, 16, boxes, rng.random((BOXES, 256), dtype=np.float32),
                                 ids, ones, ids, ones))  # fmt: skip
    rows = [
        {"img_id": "img0", "sentences": ["a red circle"]},
        {"img_id": "img1", "sentences": ["a blue square"]},
    ]
    (root / "train.json").write_text(json.dumps(rows))
    (root / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    cfg = FinetuneConfig(
        task="retrieval",
        features=[str(root / "feats.lmdb")],
        train_files=[str(root / "train.json")],
        preset="tiny",
        vocab=str(root / "vocab.txt"),
        model={"visual_feat_dim": 256},
    )
    task = build_task(cfg)
    torch.manual_seed(0)
    task.save(task.build_model(), root / "best")
    return root / "best"


def pair_score(tuned, prompt: str, regions: RegionFeatures) -> float:
    """The matching head on one (prompt, image) pair alone: no padding, no batch-mates."""
    batch = pad_text([encode_text(tuned.tokenizer, prompt, tuned.max_length)], tuned.tokenizer.pad_token_id)
    feats, boxes = region_arrays(regions)
    batch.update(
        pad_regions([feats], [boxes], sizes=image_sizes(regions.img_w, regions.img_h)).model_inputs()
    )
    return float(tuned.model(**inputs_for(tuned.model, batch)).logits[0, 0])


@torch.no_grad()
def test_order_is_the_matching_heads_score_of_each_pair(dalle_run, matcher_run, detector_dir):
    model = TextToImageModel.load(dalle_run)
    judge = MatchingReranker.load(matcher_run, detector_dir)
    tokens = sample_tokens(model, PROMPT, SampleSettings(n=4, seed=0, top_p=None))
    scores = rerank_scores(model, PROMPT, tokens, "matching", judge=judge)
    regions = judge.regions(decode(model, tokens))
    expected = [pair_score(judge.tuned, PROMPT, r) for r in regions]
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-4, atol=1e-5)
    assert len(set(np.round(expected, 5))) > 1
    assert rank(scores) == sorted(range(len(expected)), key=lambda i: -expected[i])
    assert judge.source.startswith("matching lxmert")


def test_sample_command_names_the_matcher(dalle_run, matcher_run, detector_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["generate", "sample", PROMPT, "--checkpoint", str(dalle_run), "--n", "2", "--out", str(out),
            "--rerank", "matching", "--matcher", str(matcher_run),
            "--matcher-detector", str(detector_dir)]  # fmt: skip
    assert main(argv) == 0
    ranking = json.loads((out / "ranking.json").read_text())
    assert ranking["reranker"].startswith("matching lxmert")
    assert main([*argv[:9], "--rerank", "matching"]) == 1
    assert "--rerank matching needs --matcher" in capsys.readouterr().err
    assert main([*argv[:9], "--rerank", "matching", "--matcher", str(dalle_run)]) == 1
    assert "--matcher: " in capsys.readouterr().err
