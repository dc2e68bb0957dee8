"""`xmodal ask`: the detector and a fine-tuned model on one generated image, and the answer ranking."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from extraction.draw import picture_scale
from pipelines.apps.ask import AskResult, ask, detector_settings, draw_explanation
from pipelines.cli import main
from pipelines.tasks.finetune import FinetuneConfig
from pipelines.tasks.finetuned import build_task, load_finetuned
from storage import FeatureWriter, RegionFeatures

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "color", "is", "the", "square", "?"]
ANSWERS = ["red", "green", "blue", "yellow"]
PROVENANCE = {
    "preset": "vg-r101-c4",
    "selection": "caffe",
    "min_boxes": 8,
    "max_boxes": 8,
    "config": {"min_size": 300, "max_size": 1000, "post_nms_topk": 12, "anchor_ratios": [0.5, 1.0, 2.0]},
    "selection_config": {"rule": "caffe", "conf_thresh": 0.1, "nms_thresh": 0.3},
    "weights": "random",
}


pytestmark = pytest.mark.usefixtures("one_thread")


def _regions(img_id: str, n: int, rng: np.random.Generator, dim: int = 2048) -> RegionFeatures:
    xy = rng.uniform(0, 40, (n, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(4, 20, (n, 2))], axis=1).astype(np.float32)
    ones = np.ones(n, np.float32)
    feats = rng.random((n, dim), dtype=np.float32)
    return RegionFeatures(
        img_id, 64, 80, boxes, feats, np.arange(n, dtype=np.int64), ones, np.arange(n, dtype=np.int64), ones
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A fine-tuned VQA directory as `VQATask.save` writes it: tiny model, 2048-d features."""
    root = tmp_path_factory.mktemp("ask")
    rng = np.random.default_rng(0)
    with FeatureWriter(root / "feats.lmdb", feature_dim=2048, max_boxes=8, meta=PROVENANCE) as w:
        for i in range(2):
            w.put(_regions(f"img{i}", 8, rng))
    rows = [
        {"question_id": i, "img_id": f"img{i % 2}", "sent": "what color is the square?", "label": {a: 1.0}}
        for i, a in enumerate(ANSWERS)
    ]
    (root / "train.json").write_text(json.dumps(rows))
    (root / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    cfg = FinetuneConfig(
        task="vqa",
        features=[str(root / "feats.lmdb")],
        train_files=[str(root / "train.json")],
        preset="tiny",
        vocab=str(root / "vocab.txt"),
    )
    task = build_task(cfg)
    torch.manual_seed(0)
    task.save(task.build_model(), root / "best")
    return root / "best"


def test_answers_rank_by_the_models_own_logits(checkpoint):
    tuned = load_finetuned(checkpoint)
    regions = _regions("x", 6, np.random.default_rng(1))
    result = ask(tuned, regions, "What color is the square?", top_k=3)
    # reference: the model called on tensors built here by hand
    ids = torch.tensor(
        [[WORDS.index(t) for t in ("[CLS]", "what", "color", "is", "the", "square", "?", "[SEP]")]]
    )
    scale = np.array([80, 64, 80, 64], np.float32)
    out = tuned.model(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        token_type_ids=torch.zeros_like(ids),
        visual_feats=torch.from_numpy(regions.features)[None],
        visual_pos=torch.from_numpy(np.clip(regions.boxes / scale, 0, 1))[None],
        output_attentions=True,
    )
    probs = torch.sigmoid(out.logits[0])
    order = torch.argsort(probs, descending=True)[:3]
    assert [a for a, _ in result.answers] == [tuned.answers.answer(int(i)) for i in order]
    np.testing.assert_allclose([s for _, s in result.answers], probs[order].detach().numpy(), rtol=1e-5)
    assert result.attention.shape == (6,)
    assert result.attention.sum() == pytest.approx(1.0, abs=1e-5)
    # the attended regions are the model's own region_attention, [CLS] over regions in the last x-layer
    np.testing.assert_allclose(result.attention, out.region_attention[0].detach().numpy(), rtol=1e-5)
    last = out.attentions[-1][0, :, 0, :].mean(dim=0).detach().numpy()
    np.testing.assert_allclose(result.attention, last, rtol=1e-5)


def test_detector_settings_follow_the_recorded_extraction(checkpoint):
    tuned = load_finetuned(checkpoint)
    # settings equal to the preset's (max_size, anchor_ratios, nms_thresh) are left to the preset
    s = detector_settings(tuned, None, min_size=96, max_size=None)
    assert s == {
        "preset": "vg-r101-c4",
        "selection": "caffe",
        "min_boxes": 8,
        "max_boxes": 8,
        "min_size": 96,
        "post_nms_topk": 12,
        "conf_thresh": 0.1,
        "weights": None,
    }
    assert detector_settings(tuned, "det.safetensors")["min_size"] == 300


def test_features_without_recorded_settings_are_warned_about(checkpoint, caplog):
    tuned = load_finetuned(checkpoint)
    tuned.settings = {**tuned.settings, "detector": {"merged_from": [{"path": "a.lmdb", "count": 2}]}}
    assert detector_settings(tuned, None) == {"preset": "vg-r101-c4", "weights": None}
    assert "record no detector settings" in caplog.text and "--min-size" in caplog.text


def test_explanation_marks_the_most_attended_regions():
    boxes = np.array([[0, 0, 10, 10], [40, 20, 70, 60], [10, 40, 20, 50], [60, 0, 79, 15]], np.float32)
    rec = _regions("x", 4, np.random.default_rng(2))
    rec.boxes = boxes
    image = np.full((64, 80, 3), 200, np.uint8)
    attention = np.array([0.1, 0.6, 0.05, 0.25], np.float32)
    drawing = draw_explanation(image, AskResult([("red", 0.9)], rec, attention), "what?", top=2)
    k = picture_scale(64, 80)  # small images are enlarged to a 600 px shorter side
    bar = drawing.image.shape[0] - round(64 * k)  # the question, answer and ranking above the image
    assert bar > 0 and drawing.image.shape[1] == round(80 * k)
    body = drawing.image[bar:]
    labelled = np.zeros(body.shape[:2], bool)
    for label in drawing.labels:
        if label.region >= 0:
            x1, y1, x2, y2 = label.box
            labelled[y1 - bar : y2 - bar, x1:x2] = True

    def at(y, x):
        assert not labelled[int(y * k), int(x * k)]
        return body[int(y * k), int(x * k)].tolist()

    assert at(40, 55) == [200, 200, 200]  # inside the most attended region: untouched
    assert at(55, 5) == [60, 60, 60]  # outside the top regions: dimmed to 30 %
    assert at(5, 5) == [60, 60, 60]  # region 0 is not among the top 2
    assert (body[int(20 * k), int(40 * k) : int(71 * k)] != 200).any()  # the top region's box is drawn
    # the ranking: rank and weight beside each box, and the same with the regions' names above
    boxed = [(lb.region, lb.text) for lb in drawing.labels if lb.region >= 0]
    assert boxed == [(1, "#1 0.60"), (3, "#2 0.25")]
    header = [lb.text for lb in drawing.labels if lb.region < 0]
    conf = [f"{float(c):.2f}" for c in rec.objects_conf]
    assert header == ["Q: what?", "A: red (0.90)",
                      "answer's attention over all 4 regions (any detector confidence), top 2:",
                      f"#1  0.60  attr1 obj1 {conf[1]}", f"#2  0.25  attr3 obj3 {conf[3]}"]  # fmt: skip


def test_a_box_reads_the_same_on_the_ask_picture_and_the_detection_picture():
    """The demo's detection picture labels a box "colour shape confidence"; the ask picture of the same
    scene ranks regions of any confidence, so each must carry the same label there, confidence included
    (a box the detection picture left out shows a confidence under its threshold)."""
    from extraction.draw import draw_regions

    rec = _regions("x", 4, np.random.default_rng(3))
    rec.boxes = np.array([[0, 0, 10, 10], [40, 20, 70, 60], [10, 40, 20, 50], [60, 0, 79, 15]], np.float32)
    image = np.full((64, 80, 3), 200, np.uint8)
    attention = np.array([0.1, 0.6, 0.05, 0.25], np.float32)
    names, colours = ["circle", "square", "triangle", "star"], ["red", "green", "blue", "grey"]
    ask_drawing = draw_explanation(
        image, AskResult([("red", 0.9)], rec, attention), "what?", 4, names, colours
    )
    detected = draw_regions(image, rec, names, colours, show_conf=True)
    on_detection = {lb.region: lb.text for lb in detected.labels if lb.region >= 0}
    ranking = [lb.text for lb in ask_drawing.labels if lb.region < 0 and lb.text.startswith("#")]
    order = np.argsort(-attention, kind="stable")
    assert len(ranking) == 4
    for line, region in zip(ranking, order, strict=True):
        assert line.endswith(on_detection[int(region)]), (line, on_detection[int(region)])


@pytest.mark.parametrize("size", [(40, 30), (96, 96), (480, 640), (2400, 3200), (90, 1800)])
def test_explanation_is_legible_at_any_size(size, shared_reference, assert_legible):
    from extraction.draw import load_vg_vocab

    objects, attributes = load_vg_vocab(shared_reference)
    rng = np.random.default_rng(size[0])
    h, w = size
    n = 36
    xy = rng.uniform(0, 0.7, (n, 2)) * [w, h]
    boxes = np.concatenate([xy, xy + rng.uniform(0.05, 0.3, (n, 2)) * [w, h]], axis=1).astype(np.float32)
    ids = rng.integers(0, 400, n)
    ones = np.ones(n, np.float32)
    rec = RegionFeatures("x", h, w, boxes, np.zeros((n, 4), np.float32), ids, ones, ids, ones)
    result = AskResult([("red", 0.9)], rec, rng.dirichlet(np.ones(n)).astype(np.float32))
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    drawing = draw_explanation(image, result, "what color is the thing on the left?", 5, objects, attributes)
    assert_legible(drawing, size)
    ranked = [lb.text for lb in drawing.labels if lb.text.startswith("#") and lb.region < 0]
    top = np.argsort(-result.attention)[:5]
    assert ranked == [
        f"#{k}  {result.attention[i]:.2f}  {attributes[ids[i]]} {objects[ids[i]]} 1.00"  # confidence 1
        for k, i in enumerate(top, 1)
    ]


@pytest.mark.slow
def test_ask_end_to_end_on_a_generated_image(checkpoint, tmp_path, capsys):
    img = Image.new("RGB", (120, 96), (240, 240, 240))
    draw = ImageDraw.Draw(img)
    draw.rectangle((10, 10, 50, 50), fill=(220, 30, 30))
    draw.ellipse((60, 40, 110, 90), fill=(30, 60, 220))
    path = tmp_path / "scene.png"
    img.save(path)
    explain = tmp_path / "why.png"
    code = main(
        [
            "ask",
            str(path),
            "what color is the square?",
            "--checkpoint",
            str(checkpoint),
            "--top-k",
            "3",
            "--explain",
            str(explain),
            "--min-size",
            "96",
            "--max-size",
            "128",
            "--json",
            str(tmp_path / "answers.json"),
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Q: what color is the square?"
    scores = [float(line.split()[0]) for line in lines[1:4]]
    assert [line.split()[1] for line in lines[1:4]] != [] and all(
        line.split()[1] in ANSWERS for line in lines[1:4]
    )
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    written = json.loads((tmp_path / "answers.json").read_text())
    assert [a["answer"] for a in written["answers"]] == [line.split()[1] for line in lines[1:4]]
    assert [round(a["score"], 3) for a in written["answers"]] == scores
    assert written["explain"] == str(explain)
    picture = cv2.imread(str(explain))
    assert picture is not None and picture.shape[1] == 120 * 600 / 96 and picture.shape[0] > 600


def test_ask_refuses_a_missing_image(checkpoint, tmp_path, capsys):
    code = main(["ask", str(tmp_path / "none.png"), "what?", "--checkpoint", str(checkpoint)])
    assert code == 1
    assert "none.png" in capsys.readouterr().err


def test_ask_json_dash_prints_one_json_object(tmp_path, capsys, monkeypatch):
    import pipelines.apps.ask

    def answered(image, question, checkpoint, **kw):
        return AskResult([("red", 0.75), ("blue", 0.125)], _regions("x", 2, np.random.default_rng(3)), None)

    monkeypatch.setattr(pipelines.apps.ask, "ask_image", answered)
    argv = ["ask", "scene.png", "what color?", "--checkpoint", "ckpt", "--top-k", "2", "--json", "-"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == {
        "image": "scene.png",
        "question": "what color?",
        "answers": [{"answer": "red", "score": 0.75}, {"answer": "blue", "score": 0.125}],
        "explain": None,
    }


def test_the_random_weights_warning_is_printed_once_as_one_line(checkpoint, tmp_path):
    """As a user runs it (its own process, the CLI's logging): `ask` with random detector weights warns
    once, on one line, and still answers."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "scene.png"
    Image.new("RGB", (120, 96), (200, 30, 30)).save(path)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "pipelines.cli", "ask", str(path), "what color is the square?"]
    argv += ["--checkpoint", str(checkpoint), "--device", "cpu", "--min-size", "96", "--max-size", "128"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "RANDOM" in line]
    assert len(warned) == 1, proc.stderr
    assert "WARNING" in warned[0] and "meaningless" in warned[0]
    assert "Detector.build(" not in proc.stderr  # no source line under the warning
    assert proc.stdout.startswith("Q: what color is the square?")
