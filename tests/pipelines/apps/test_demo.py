"""`xmodal demo`: the baselines it reports, and reduced end-to-end runs: every stage through its `xmodal`
command, the report's pictures, and the same numbers from the same seed."""

from __future__ import annotations

import html
import json
import re
import shlex
from pathlib import Path

import pytest
from PIL import Image

from pipelines.apps.demo.caption_facts import agreeing_example, caption_agreement
from pipelines.apps.demo.demo import (
    DEMO_MARKER,
    DemoConfig,
    DemoError,
    _Paths,
    baselines,
    caption_summary,
    run_demo,
    score_predictions,
    with_other_images,
)
from pipelines.apps.demo.report import TASK_LOSSES
from pipelines.apps.demo.synthetic import SyntheticConfig, description, generate, load_scenes
from pipelines.cli import build_parser, main
from storage import FeatureReader

TRAIN = [
    {"question_id": 1, "question_type": "how many", "label": {"2": 1.0}},
    {"question_id": 2, "question_type": "how many", "label": {"2": 1.0}},
    {"question_id": 3, "question_type": "how many", "label": {"1": 1.0}},
    {"question_id": 4, "question_type": "what color is the", "label": {"red": 1.0}},
    {"question_id": 5, "question_type": "what color is the", "label": {"red": 1.0}},
    {"question_id": 6, "question_type": "what color is the", "label": {"blue": 1.0}},
    {"question_id": 7, "question_type": "is the", "label": {"left": 1.0}},
    {"question_id": 8, "question_type": "is the", "label": {"left": 1.0}},
    {"question_id": 9, "question_type": "is the", "label": {"left": 1.0}},
    {"question_id": 10, "question_type": "is the", "label": {"left": 1.0}},
]
TEST = [
    {"question_id": 11, "question_type": "how many", "label": {"2": 1.0}},
    {"question_id": 12, "question_type": "what color is the", "label": {"blue": 1.0}},
    {"question_id": 13, "question_type": "what color is the", "label": {"red": 0.6, "blue": 0.3}},
    {"question_id": 14, "question_type": "is the", "label": {"right": 1.0}},
]


def test_baselines_by_hand() -> None:
    b = baselines(TRAIN, TEST)
    assert b["majority_answer"] == "left"  # 4 of 10 training answers
    assert b["baseline_accuracy"] == 0.0
    # per type: "2", "red", "left" -> 1.0, 0.0, 0.6, 0.0
    assert b["prior_baseline_accuracy"] == pytest.approx(100 * 1.6 / 4)
    assert b["per_type_prior_baseline"] == {"how many": 100.0, "is the": 0.0, "what color is the": 30.0}


def test_scoring_uses_soft_scores_and_refuses_missing_answers(tmp_path: Path) -> None:
    preds = tmp_path / "p.json"
    preds.write_text(json.dumps([{"question_id": q, "answer": a} for q, a in
                                 [(11, "2"), (12, "red"), (13, "blue"), (14, "right")]]))  # fmt: skip
    scored = score_predictions(preds, TEST)
    assert scored["accuracy"] == pytest.approx(100 * (1 + 0 + 0.3 + 1) / 4, abs=0.01)
    assert scored["per_type_accuracy"]["what color is the"] == pytest.approx(15.0)
    preds.write_text(json.dumps([{"question_id": 11, "answer": "2"}]))
    with pytest.raises(DemoError, match="no answer for 3 test questions"):
        score_predictions(preds, TEST)


def test_other_images_moves_every_question_to_another_held_out_image() -> None:
    rows = [{"question_id": q, "img_id": f"img{q % 5}", "label": {"x": 1.0}} for q in range(20)]
    swapped = with_other_images(rows, seed=3)
    assert [r["question_id"] for r in swapped] == [r["question_id"] for r in rows]
    assert [r["label"] for r in swapped] == [r["label"] for r in rows]
    assert all(s["img_id"] != r["img_id"] for r, s in zip(rows, swapped, strict=True))
    # one permutation of the images: questions of one image all move to the same other image
    moved = {(r["img_id"], s["img_id"]) for r, s in zip(rows, swapped, strict=True)}
    assert len(moved) == 5 and sorted(b for _, b in moved) == [f"img{i}" for i in range(5)]
    assert with_other_images(rows, seed=3) == swapped and with_other_images(rows, seed=4) != swapped
    with pytest.raises(DemoError, match="1 held-out image"):
        with_other_images(rows[:1], seed=0)


def test_the_caption_summary_counts_captions_that_state_their_scene(tmp_path: Path) -> None:
    """caption_summary on a hand-made evaluation: half the test captions are the scenes' descriptions, the
    rest the count-and-background template; the figure, the example and the first miss follow."""
    data = generate(tmp_path / "data", SyntheticConfig(num_images=40, image_size=48, seed=2, max_shapes=3))
    paths = _Paths(tmp_path)
    scenes = dict(enumerate(load_scenes(data.scenes)))
    test = sorted(k for k, s in scenes.items() if s.split == "test")
    right = set(test[::2])
    said = {
        k: description(scenes[k]) if k in right else "2 shapes on a plain white background." for k in test
    }
    paths.captions.parent.mkdir(parents=True)
    paths.captions.write_text(json.dumps([{"image_id": k, "caption": c} for k, c in said.items()]))
    paths.captions.with_suffix(".metrics.json").write_text(json.dumps({"CIDEr": 1.0}))
    shown = agreeing_example(said, scenes)
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "caption.json").write_text(
        json.dumps({"image": f"{scenes[shown].img_id}.png", "caption": said[shown]})
    )
    row = next(r for r in json.loads(data.descriptions.read_text())["images"] if r["cocoid"] == shown)
    summary = caption_summary(data, paths, row)
    agreement = summary["agreement"]
    assert agreement["images"] == len(test) == summary["test_images"]
    assert agreement["names_every_shape"] == round(100 * len(right) / len(test), 1)
    assert summary["ask"] == {"image": f"{scenes[shown].img_id}.png", "caption": said[shown],
                              "truth": [description(scenes[shown])], "agrees": True}  # fmt: skip
    most = max(len(scenes[k].shapes) for k in right)
    assert len(scenes[shown].shapes) == most and shown == min(
        k for k in right if len(scenes[k].shapes) == most
    )
    missed = min(set(test) - right)
    assert summary["missed"] == {"image": scenes[missed].img_id, "caption": said[missed],
                                 "truth": [description(scenes[missed])]}  # fmt: skip
    # the constant caption is one training description, right for few test scenes
    assert summary["baseline_agreement"]["names_every_shape"] < 20
    assert summary["cider_d"] > summary["baseline_cider_d"]


QUICK = ["demo", "--quick", "--seed", "1"]
DETECTOR_STAGES = ("detector-train", "detector-evaluate")  # the demo trains its detector first
STAGES = ("extract", "pretrain", "finetune", "evaluate", "evaluate other images", "ask")
COMMANDS = ("detector", "detector", "extract", "pretrain", "finetune", "evaluate", "evaluate", "ask")
CAPTION_STAGES = ("caption-finetune", "caption-evaluate", "caption-ask")  # then the captioning ones


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One reduced demo run, shared by the end-to-end and the determinism checks."""
    workdir = tmp_path_factory.mktemp("quick") / "demo"
    assert main([*QUICK, "--workdir", str(workdir)]) == 0
    return workdir


def _argv(line: str) -> list[str]:
    """A recorded command line without its environment prefix and `xmodal`."""
    words = shlex.split(line)
    while "=" in words[0]:
        words.pop(0)
    assert words[0] == "xmodal", line
    return words[1:]


@pytest.mark.slow
def test_quick_demo_end_to_end(quick_demo: Path) -> None:
    workdir = quick_demo
    summary = json.loads((workdir / "summary.json").read_text())
    for key in ("accuracy", "baseline_accuracy", "prior_baseline_accuracy", "elapsed_s", "stage_s"):
        assert key in summary, key
    assert summary["detector_trained"] and summary["detector_weights"] == str(workdir / "runs/detector/best")
    assert set(summary["detector"]) >= {"AP", "AP50", "AP75", "attr_acc"}
    assert list(summary["stage_s"]) == [
        "generate", *DETECTOR_STAGES, "extract", "probe", *STAGES[1:], *CAPTION_STAGES, "report"
    ]  # fmt: skip

    test_rows = json.loads((workdir / "data" / "vqa_test.json").read_text())
    assert summary["test_questions"] == len(test_rows)
    rescored = score_predictions(workdir / "runs" / "vqa" / "test_predictions.json", test_rows)
    assert rescored["accuracy"] == summary["accuracy"]
    # the same model on the held-out questions, each asked about another held-out image's regions
    other_split = json.loads((workdir / "data" / "vqa_test_other_images.json").read_text())
    assert [r["question_id"] for r in other_split] == [r["question_id"] for r in test_rows]
    test_images = {r["img_id"] for r in test_rows}
    for moved, row in zip(other_split, test_rows, strict=True):
        assert moved["img_id"] in test_images and moved["img_id"] != row["img_id"]
    other = score_predictions(workdir / "runs" / "vqa" / "test_predictions_other_images.json", test_rows)
    assert summary["other_images_accuracy"] == other["accuracy"]
    assert summary["image_gain_points"] == pytest.approx(summary["accuracy"] - other["accuracy"], abs=0.01)
    assert summary["evaluate_accuracy"] == pytest.approx(
        summary["accuracy"], abs=0.01
    )  # `xmodal evaluate`'s own

    reader = FeatureReader(workdir / "features.lmdb")
    try:
        assert len(reader) == len(list((workdir / "data" / "images").iterdir()))
        # the store records the demo's own detector: its weights, settings and class names
        provenance = reader.meta["provenance"]
        assert provenance["weights"] == summary["detector_weights"] and provenance["preset"] == "c4-small"
        assert provenance["classes"] == ["circle", "square", "triangle"]
        assert provenance["attributes"] == ["red", "green", "blue", "yellow"]
    finally:
        reader.close()
    assert (workdir / "runs" / "pretrain" / "metrics.jsonl").is_file()

    report = workdir / "report.html"
    text = report.read_text()
    assert "RANDOM DETECTOR WEIGHTS" not in text and "<h2>Headline</h2>" in text
    matters = text[text.index("Does the model use the image?") :]
    for key in ("accuracy", "other_images_accuracy", "prior_baseline_accuracy", "baseline_accuracy"):
        assert f"<td>{summary[key]:.1f}%</td>" in matters[: matters.index("<h2>")], key
    linked = {(report.parent / src).resolve() for src in re.findall(r'<img src="([^"]+)"', text)}
    pics = workdir / "report"
    test_images = sorted({r["img_id"] for r in test_rows})
    detections = [pics / f"detections_{img_id}.png" for img_id in test_images[:3]]
    expected = [
        pics / "accuracy.png",
        pics / "loss_curves.png",
        *detections,
        pics / "ask_attention.png",
        pics / "caption_attention.png",  # what `xmodal ask --caption --explain` drew
    ]
    for png in expected:
        assert png.is_file() and Image.open(png).format == "PNG", png.name
        assert png.resolve() in linked, f"{png.name} is not shown in the report"
    assert len(linked) == len(expected)

    # the report lists the real commands, each one parsed by the `xmodal` command line
    assert [_argv(c)[0] for c in summary["commands"]] == [*COMMANDS, "finetune", "evaluate", "ask"]
    assert [_argv(c)[1] for c in summary["commands"][:2]] == ["train", "evaluate"]
    caption = summary["caption"]
    assert {"CIDEr", "Bleu_4", "ROUGE_L"} <= set(caption["metrics"])
    assert caption["test_images"] > 0 and caption["ask"]["truth"]
    # the captioner learns the scenes' descriptions; the figure and the example come from its test captions
    finetune = next(c for c in summary["commands"] if " finetune caption " in c)
    assert "descriptions.json:train" in finetune
    captions = {
        r["image_id"]: r["caption"]
        for r in json.loads((workdir / "runs/caption/test_captions.json").read_text())
    }
    scenes = dict(enumerate(load_scenes(workdir / "data" / "scenes.json")))
    assert caption["agreement"] == caption_agreement(captions, scenes)
    shown = agreeing_example(captions, scenes)
    assert caption["ask"]["agrees"] == (shown is not None)
    if shown is not None:
        assert Path(caption["ask"]["image"]).stem == scenes[shown].img_id
        assert caption["ask"]["truth"] == [description(scenes[shown])]
    assert "Captioning (Up-Down)" in text
    parser = build_parser()
    for line in summary["commands"]:
        assert html.escape(line) in text
        parser.parse_args(_argv(line))


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


@pytest.mark.slow
def test_the_detection_pictures_name_shapes_that_are_there(quick_demo: Path, tmp_path: Path) -> None:
    """The demo's detector, trained in the quick run, draws vocabulary names, and its confident boxes lie
    on the scenes' shapes."""
    from pipelines.apps.demo.report import DRAWN_CONFIDENCE, draw_detections
    from pipelines.apps.demo.synthetic import COLOURS, SHAPES, load_scenes

    scenes = {s.img_id: s for s in load_scenes(quick_demo / "data" / "scenes.json")}
    reader = FeatureReader(quick_demo / "features.lmdb")
    try:
        provenance = reader.meta["provenance"]
        names, attrs = provenance["classes"], provenance["attributes"]
        test_ids = sorted(i for i, s in scenes.items() if s.split == "test")
        drawing = draw_detections(
            quick_demo / "data" / "images" / f"{test_ids[0]}.png", reader[test_ids[0]], tmp_path / "d.png",
            names=names, attr_names=attrs, min_conf=DRAWN_CONFIDENCE,
        )  # fmt: skip
        labels = [lb.text for lb in drawing.labels if lb.region >= 0]
        assert labels
        for text in labels:  # "green circle 0.97"
            colour, shape, conf = text.split()
            assert colour in COLOURS and shape in SHAPES and 0.0 <= float(conf) <= 1.0, text
        found = total = 0
        for img_id in test_ids:
            rec = reader[img_id]
            boxes = rec.boxes[rec.objects_conf >= DRAWN_CONFIDENCE].tolist()
            for shape in scenes[img_id].shapes:
                x1, y1, x2, y2 = shape.box
                truth = (x1, y1, x2 + 1, y2 + 1)  # inclusive pixels
                total += 1
                found += any(_iou(truth, b) >= 0.5 for b in boxes)
    finally:
        reader.close()
    assert found > 0.6 * total, f"{found} of {total} shapes have a confident box with IoU >= 0.5"


def _probe_accuracy(train_x, train_y, test_x, test_y) -> float:
    """Held-out accuracy of a multinomial logistic regression (L-BFGS, standardised inputs, small L2)."""
    import numpy as np
    import torch

    labels = sorted(set(train_y))
    xt, xs = torch.tensor(np.stack(train_x)), torch.tensor(np.stack(test_x))
    yt = torch.tensor([labels.index(y) for y in train_y])
    ys = torch.tensor([labels.index(y) if y in labels else -1 for y in test_y])
    mean, std = xt.mean(0), xt.std(0) + 1e-6
    torch.manual_seed(0)
    linear = torch.nn.Linear(xt.shape[1], len(labels))
    opt = torch.optim.LBFGS(linear.parameters(), max_iter=200)

    def closure():
        opt.zero_grad()
        loss = (
            torch.nn.functional.cross_entropy(linear((xt - mean) / std), yt)
            + 1e-3 * linear.weight.square().sum()
        )
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return float((linear((xs - mean) / std).argmax(1) == ys).float().mean())


@pytest.mark.slow
def test_features_of_the_demo_detector_tell_shape_and_colour_apart(quick_demo: Path) -> None:
    """A linear probe on the stored features of the regions lying on a shape (IoU >= 0.5) learns the shape
    and colour from the training scenes and predicts them on held-out ones (the detector never saw those)."""
    from pipelines.apps.demo.synthetic import load_scenes

    scenes = load_scenes(quick_demo / "data" / "scenes.json")
    reader = FeatureReader(quick_demo / "features.lmdb")
    x: dict[bool, list] = {True: [], False: []}
    y: dict[bool, list] = {True: [], False: []}
    try:
        for scene in scenes:
            rec = reader[scene.img_id]
            for shape in scene.shapes:
                x1, y1, x2, y2 = shape.box
                ious = [_iou((x1, y1, x2 + 1, y2 + 1), b) for b in rec.boxes.tolist()]
                best = max(range(len(ious)), key=ious.__getitem__)
                if ious[best] >= 0.5:
                    x[scene.split == "train"].append(rec.features[best].astype("float32"))
                    y[scene.split == "train"].append((shape.shape, shape.colour))
    finally:
        reader.close()
    assert len(y[False]) >= 20, "too few held-out shapes were found to probe"
    # the quick run's detector trains 400 steps on 42 scenes: colour is learnt, shape partly (chance is
    # 1/3); the full demo's detector (900 steps, 210 scenes) reaches >= 0.95 on both, in its summary
    for k, what, bar in ((0, "shape", 0.6), (1, "colour", 0.95)):
        train_y, test_y = [v[k] for v in y[True]], [v[k] for v in y[False]]
        accuracy = _probe_accuracy(x[True], train_y, x[False], test_y)
        assert accuracy >= bar, f"{what}: linear probe {accuracy:.3f} on {len(test_y)} held-out regions"
    summary = json.loads((quick_demo / "summary.json").read_text())
    assert summary["probe"]["held_out_regions"] == len(y[False])


@pytest.mark.slow
def test_a_recorded_command_reruns_its_stage(quick_demo: Path, tmp_path: Path) -> None:
    commands = json.loads((quick_demo / "summary.json").read_text())["commands"]
    line = next(c for c in commands if " evaluate vqa " in c)  # the held-out split with its own images
    argv = _argv(line)
    out = tmp_path / "again.json"
    argv[argv.index("--out") + 1] = str(out)
    assert main(argv) == 0
    assert json.loads(out.read_text()) == json.loads(
        (quick_demo / "runs/vqa/test_predictions.json").read_text()
    )


def _stored(store: Path) -> dict[str, bytes]:
    reader = FeatureReader(store)
    try:
        return {img_id: reader.get_encoded(img_id) for img_id in reader}
    finally:
        reader.close()


def _losses(metrics: Path) -> list[dict]:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if "loss" in k or k in TASK_LOSSES or k == "step"} for r in rows]


@pytest.mark.slow
def test_a_fixed_seed_gives_the_same_numbers(tmp_path: Path) -> None:
    """Two quick runs from one seed give the same numbers. Their detectors train for a few steps only: every
    stage runs the quick demo's code, and figures need not be good to be compared (the quick demo's 400
    detector steps are most of its time)."""
    first_dir, again = tmp_path / "first", tmp_path / "again"
    for workdir in (first_dir, again):
        run_demo(DemoConfig.quick(workdir=workdir, seed=1, detector_steps=20), main)
    first, second = (json.loads((d / "summary.json").read_text()) for d in (first_dir, again))
    for key in ("accuracy", "baseline_accuracy", "prior_baseline_accuracy", "evaluate_accuracy",
                "per_type_accuracy", "majority_answer", "other_images_accuracy"):  # fmt: skip
        assert first[key] == second[key], key
    figures = [
        {k: v for k, v in s["detector"].items() if k not in ("weights", "annotations")}
        for s in (first, second)
    ]
    assert figures[0] == figures[1] and "AP" in figures[0]
    assert _stored(first_dir / "features.lmdb") == _stored(again / "features.lmdb")
    for run in ("detector", "pretrain", "vqa", "caption"):
        assert _losses(first_dir / "runs" / run / "metrics.jsonl") == _losses(
            again / "runs" / run / "metrics.jsonl"
        ), run
    for predictions in ("runs/vqa/test_predictions.json", "runs/caption/test_captions.json"):
        assert json.loads((first_dir / predictions).read_text()) == json.loads(
            (again / predictions).read_text()
        ), predictions


def test_a_folder_the_demo_did_not_make_is_left_alone(tmp_path, caplog):
    workdir = tmp_path / "mine"
    (workdir / "data").mkdir(parents=True)
    precious = workdir / "data" / "thesis.tex"
    precious.write_text("two years of work")
    assert main([*QUICK, "--workdir", str(workdir)]) == 1
    assert "not made by `xmodal demo`" in caplog.text
    assert precious.read_text() == "two years of work"
    assert sorted(p.name for p in workdir.iterdir()) == ["data"]


def test_the_demo_marks_its_folder_and_reruns_in_it(quick_demo):
    assert (quick_demo / DEMO_MARKER).is_file()
    paths = _Paths(quick_demo)
    paths.claim()  # its own folder: accepted again
    assert (quick_demo / "summary.json").is_file()
