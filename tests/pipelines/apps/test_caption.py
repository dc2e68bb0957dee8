"""`xmodal ask IMAGE --caption`: detector regions → a caption, and the attention-over-time picture."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from pipelines.apps.caption import caption_regions
from pipelines.cli import main
from pipelines.tasks.finetune import FinetuneConfig
from pipelines.tasks.finetuned import build_task, load_finetuned
from storage import FeatureWriter, RegionFeatures

PROVENANCE = {
    "preset": "vg-r101-c4",
    "selection": "caffe",
    "min_boxes": 6,
    "max_boxes": 6,
    "config": {"min_size": 96, "max_size": 128, "post_nms_topk": 12},
    "selection_config": {"rule": "caffe", "conf_thresh": 0.1, "nms_thresh": 0.3},
    "weights": "random",
}

pytestmark = pytest.mark.usefixtures("one_thread")


def _regions(img_id: str, n: int, rng: np.random.Generator) -> RegionFeatures:
    xy = rng.uniform(0, 40, (n, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(4, 20, (n, 2))], axis=1).astype(np.float32)
    ones = np.ones(n, np.float32)
    ids = np.arange(n, dtype=np.int64)
    return RegionFeatures(
        img_id, 64, 80, boxes, rng.random((n, 2048), dtype=np.float32), ids, ones, ids, ones
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A captioning directory as `CaptionTask.save` writes it: tiny Up-Down model over 2048-d features."""
    root = tmp_path_factory.mktemp("caption")
    rng = np.random.default_rng(0)
    with FeatureWriter(root / "feats.lmdb", feature_dim=2048, max_boxes=6, meta=PROVENANCE) as w:
        for i in range(2):
            w.put(_regions(f"img{i}", 6, rng))
    images = [
        {"filename": f"img{i}.jpg", "split": "train", "cocoid": i,
         "sentences": [{"tokens": ["a", "red", "square", "and", "a", "blue", "circle"]}]}
        for i in range(2)
    ]  # fmt: skip
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))
    cfg = FinetuneConfig(
        task="caption",
        arch="updown",
        features=[str(root / "feats.lmdb")],
        train_files=[str(root / "dataset_coco.json")],
        preset="tiny",
        model={"visual_feat_dim": 2048},
        vocab_min_count=1,
    )
    task = build_task(cfg)
    torch.manual_seed(0)
    task.save(task.build_model(), root / "best")
    return root / "best"


def test_caption_words_come_with_their_attention(checkpoint):
    tuned = load_finetuned(checkpoint)
    regions = _regions("x", 5, np.random.default_rng(1))
    result = caption_regions(tuned, regions, beam_size=2)
    assert result.caption == " ".join(result.words)
    assert all(w in tuned.tokenizer.index and not w.startswith("<") for w in result.words)
    assert result.attentions.shape == (len(result.words), 5)
    np.testing.assert_allclose(result.attentions.sum(1), 1.0, rtol=1e-5)


def test_ask_caption_end_to_end(checkpoint, tmp_path, capsys):
    img = Image.new("RGB", (120, 96), (240, 240, 240))
    draw = ImageDraw.Draw(img)
    draw.rectangle((10, 10, 50, 50), fill=(220, 30, 30))
    draw.ellipse((60, 40, 110, 90), fill=(30, 60, 220))
    path = tmp_path / "scene.png"
    img.save(path)
    explain = tmp_path / "words.png"
    argv = ["ask", str(path), "--caption", "--checkpoint", str(checkpoint), "--explain", str(explain),
            "--min-size", "96", "--max-size", "128", "--json", str(tmp_path / "caption.json")]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    written = json.loads((tmp_path / "caption.json").read_text())
    assert printed[0] == written["caption"] == " ".join(written["words"])
    picture = cv2.imread(str(explain))
    assert picture is not None and picture.shape[0] > 224  # the caption panel plus one per word


def test_ask_caption_refuses_a_question_and_a_vqa_style_call_needs_one(checkpoint, capsys):
    assert main(["ask", "x.png", "what?", "--caption", "--checkpoint", str(checkpoint)]) == 1
    assert "--caption takes no question" in capsys.readouterr().err
    assert main(["ask", "x.png", "--checkpoint", str(checkpoint)]) == 1
    assert "give a question" in capsys.readouterr().err
