"""`xmodal detector train|evaluate|convert-vg` on generated scenes (c4-small at 64-128 px): one-line errors,
counted or strict bad boxes, the metrics table and JSON line, VG conversion, and trained weights in
`xmodal extract` and `xmodal features show`."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
from PIL import Image

from extraction.weights import read_detector_dir
from pipelines.apps.demo.synthetic import COLOURS, SHAPES, SyntheticConfig, generate
from pipelines.cli import main as xmodal

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = [
    "task.training.min_sizes=[64,80]",
    "task.training.max_size=128",
    "task.detector.min_size=64",
    "task.detector.max_size=128",
    "task.training.roi_batch_size=32",
    "train.loader_workers=0",
]
METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "attr_acc")


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    """12 scenes of 64 px (8 for training, 2 held out for evaluation, 2 more)."""
    return generate(tmp_path_factory.mktemp("scenes"), SyntheticConfig(num_images=12, image_size=64))


@pytest.fixture(scope="module")
def run_dir(scenes, tmp_path_factory):
    """A 4-step c4-small run on the scenes."""
    out = tmp_path_factory.mktemp("runs") / "run"
    assert xmodal(_train_argv(scenes.images_dir, scenes.detection["train"], out, "--max-steps", "4")) == 0
    return out


def _train_argv(images, annotations, out, *extra: str) -> list[str]:
    return [
        "detector",
        "train",
        "--preset",
        "c4-small",
        "--images",
        str(images),
        "--annotations",
        str(annotations),
        "--out",
        str(out),
        "--batch-size",
        "2",
        *extra,
        *SMALL,
    ]


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _copy_data(scenes, tmp_path):
    """The scenes' training images and annotations, free to edit."""
    images = tmp_path / "images"
    doc = json.loads(scenes.detection["train"].read_text())
    images.mkdir()
    for row in doc["images"]:
        shutil.copy(scenes.images_dir / row["file_name"], images / row["file_name"])
    return images, doc


def test_a_missing_image_is_one_line_naming_it(scenes, tmp_path, capsys):
    images, doc = _copy_data(scenes, tmp_path)
    gone = doc["images"][3]["file_name"]
    (images / gone).unlink()
    annotations = tmp_path / "train.json"
    annotations.write_text(json.dumps(doc))
    assert xmodal(_train_argv(images, annotations, tmp_path / "run", "--max-steps", "1")) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("xmodal detector train: ") and repr(gone) in line and str(annotations) in line
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_an_unreadable_image_stops_training_with_one_line_naming_it(scenes, tmp_path, capsys):
    """An image that only fails when a loader worker decodes it: the error comes back as one line, not the
    worker's traceback."""
    images, doc = _copy_data(scenes, tmp_path)
    bad = doc["images"][3]["file_name"]
    (images / bad).write_bytes((images / bad).read_bytes()[:60])  # truncated PNG
    annotations = tmp_path / "train.json"
    annotations.write_text(json.dumps(doc))
    argv = _train_argv(images, annotations, tmp_path / "run", "--max-steps", "3", "train.loader_workers=1")
    assert xmodal(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = _one_line(err)
    assert line.startswith("xmodal detector train: ") and bad in line


def test_a_box_outside_its_image_is_counted_or_under_strict_stops_the_run(scenes, tmp_path, capsys, caplog):
    images, doc = _copy_data(scenes, tmp_path)
    ann = doc["annotations"][0]
    ann["bbox"] = [40, 40, 50, 50]  # reaches x = y = 90 in a 64 x 64 image
    annotations = tmp_path / "train.json"
    annotations.write_text(json.dumps(doc))
    assert xmodal(_train_argv(images, annotations, tmp_path / "counted", "--max-steps", "1")) == 0
    assert f"{annotations}: 1 clipped (pass --strict" in caplog.text
    capsys.readouterr()
    argv = _train_argv(images, annotations, tmp_path / "strict", "--max-steps", "1", "--strict")
    assert xmodal(argv) == 1
    line = _one_line(capsys.readouterr().err)
    assert f"annotation {ann['id']} box" in line and "reaches outside the 64x64 image" in line
    assert str(annotations) in line


def test_an_unknown_preset_exits_1(scenes, tmp_path, capsys):
    argv = _train_argv(scenes.images_dir, scenes.detection["train"], tmp_path / "run", "--max-steps", "1")
    with pytest.raises(SystemExit) as exc:
        xmodal([a if a != "c4-small" else "c4-huge" for a in argv])
    assert exc.value.code == 1 and "invalid choice: 'c4-huge'" in capsys.readouterr().err
    assert xmodal([*argv, "task.preset=c4-huge"]) == 1  # the same name reaching the task from a config
    line = _one_line(capsys.readouterr().err)
    assert "unknown detector preset 'c4-huge'" in line and "c4-small" in line


def _evaluate_argv(run_dir, scenes, annotations) -> list[str]:
    weights, images = str(run_dir / "last"), str(scenes.images_dir)
    return [
        "detector",
        "evaluate",
        "--weights",
        weights,
        "--images",
        images,
        "--annotations",
        str(annotations),
    ]


def test_evaluate_prints_a_table_then_a_json_line(run_dir, scenes, tmp_path, capsys):
    held_out = scenes.detection["valid"]
    assert xmodal([*_evaluate_argv(run_dir, scenes, held_out), "--out", str(tmp_path / "m.json")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    metrics = json.loads(lines[-1])
    assert set(METRICS) <= metrics.keys()
    assert metrics["weights"] == str(run_dir / "last") and metrics["annotations"] == str(held_out)
    assert metrics["images"] == len(json.loads(held_out.read_text())["images"])
    for name in METRICS:
        assert metrics[name] is None or 0.0 <= metrics[name] <= 1.0, name  # null: no box of that size
    table = {line.split()[0]: line.split()[1] for line in lines[1:-1]}
    assert lines[0].split() == ["metric", "value"] and set(METRICS) <= table.keys()
    assert json.loads((tmp_path / "m.json").read_text()).keys() == metrics.keys()


def test_evaluate_table_shows_the_image_count_as_a_count(run_dir, scenes, capsys):
    assert xmodal(_evaluate_argv(run_dir, scenes, scenes.detection["valid"])) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    images = json.loads(lines[-1])["images"]
    assert f"on {images} images" in lines


def test_evaluate_refuses_annotations_with_other_categories(run_dir, scenes, tmp_path, capsys):
    doc = json.loads(scenes.detection["valid"].read_text())
    doc["categories"][0]["name"] = "disc"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    assert xmodal(_evaluate_argv(run_dir, scenes, other)) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("xmodal detector evaluate: ") and str(other) in line and "categories" in line


def _vg_files(tmp_path) -> dict[str, str]:
    """Two Visual Genome images (64 x 64) with their objects, attributes and image data, and vocabularies."""
    files = {
        "objects-vocab": "ball\nbox,crate\nlamp\n",
        "attributes-vocab": "red\ngray,grey\nshiny\nwooden\n",
    }
    paths = {}
    for name, text in files.items():
        paths[name] = tmp_path / f"{name}.txt"
        paths[name].write_text(text)
    objects = [
        {
            "image_id": 1,
            "objects": [
                {"object_id": 11, "x": 4, "y": 6, "w": 30, "h": 24, "names": ["Red Ball."]},
                {"object_id": 12, "x": 36, "y": 30, "w": 40, "h": 20, "names": ["crate"]},  # clipped
            ],
        },
        {
            "image_id": 2,
            "objects": [
                {"object_id": 21, "x": 10, "y": 10, "w": 40, "h": 44, "names": ["lamp"]},
                {"object_id": 22, "x": 0, "y": 0, "w": 8, "h": 8, "names": ["zebra"]},  # not in the vocab
            ],
        },
    ]
    attributes = [
        {"image_id": 1, "attributes": [{"object_id": 12, "attributes": ["grey and wooden"]}]},
        {"image_id": 2, "attributes": [{"object_id": 21, "attributes": ["shiny"]}]},
    ]
    image_data = [{"image_id": i, "width": 64, "height": 64} for i in (1, 2)]
    for name, doc in (("objects", objects), ("attributes", attributes), ("image-data", image_data)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(doc))
    images = tmp_path / "vg_images"
    images.mkdir()
    for i, colour in ((1, (200, 30, 30)), (2, (30, 30, 200))):
        Image.new("RGB", (64, 64), colour).save(images / f"{i}.jpg")
    return {"images": str(images), **{k: str(v) for k, v in paths.items()}}


def test_convert_vg_writes_json_that_detector_train_takes(tmp_path, capsys):
    vg = _vg_files(tmp_path)
    out = tmp_path / "vg_train.json"
    argv = ["detector", "convert-vg", "--out", str(out)]
    argv += [f"--{k}={vg[k]}" for k in ("objects", "attributes", "image-data", "objects-vocab")]
    assert xmodal([*argv, f"--attributes-vocab={vg['attributes-vocab']}"]) == 0
    assert "2 images, 3 annotations, 1 unknown object" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [a["name"] for a in doc["categories"]] == ["ball", "box", "lamp"]
    assert [a["attribute_ids"] for a in doc["annotations"]] == [[1], [2, 4], [3]]
    run = tmp_path / "run"
    assert xmodal(_train_argv(vg["images"], out, run, "--max-steps", "1")) == 0
    meta = read_detector_dir(run / "last")
    assert meta["classes"] == ["ball", "box", "lamp"]
    assert meta["attributes"] == ["red", "gray", "shiny", "wooden"]


def _extract_argv(images, store, weights) -> list[str]:
    small = ["--min-boxes", "3", "--max-boxes", "3", "--batch-size", "2", "--workers", "1", "--no-progress"]
    return ["extract", str(images), "--out", str(store), "--weights", str(weights), *small]


class _RayStarted(Exception):
    pass


def _reaches_ray(argv: list[str], monkeypatch, caplog) -> None:
    """`xmodal extract` passes every check it makes before starting Ray (which is not started here)."""
    from pipelines.jobs.extract import driver

    def no_ray(*args, **kwargs):
        raise _RayStarted

    monkeypatch.setattr(driver, "init_ray", no_ray)
    try:
        rc = xmodal(argv)
    except _RayStarted:
        return
    raise AssertionError(f"exit {rc} before Ray: {caplog.text}")


def test_extract_checks_a_run_directory_before_ray_starts(run_dir, scenes, tmp_path, monkeypatch, caplog):
    _reaches_ray(
        _extract_argv(scenes.images_dir, tmp_path / "feats.lmdb", run_dir / "last"), monkeypatch, caplog
    )


def test_extract_resumes_a_store_made_with_a_run_directory(run_dir, scenes, tmp_path, monkeypatch, caplog):
    """The store as a first run with RUN/last leaves it: the same command again must resume it."""
    from extraction import Detector
    from pipelines.jobs.extract.config import ExtractConfig, recorded_settings
    from storage import FeatureWriter

    weights = run_dir / "last"
    detector = Detector.build(weights=weights, min_boxes=3, max_boxes=3)
    cfg = ExtractConfig(inputs=[str(scenes.images_dir)], weights=str(weights), min_boxes=3, max_boxes=3)
    provenance = {**detector.provenance(), "extract_settings": recorded_settings(cfg, detector.provenance())}
    store = tmp_path / "feats.lmdb"
    writer = FeatureWriter(store, feature_dim=detector.feature_dim, max_boxes=3, meta=provenance)
    writer.put(detector.detect([sorted(scenes.images_dir.iterdir())[0]])[0])
    writer.close()
    _reaches_ray(_extract_argv(scenes.images_dir, store, weights), monkeypatch, caplog)


@pytest.mark.slow
def test_extract_with_trained_weights_records_the_names_and_show_draws_them(
    run_dir, scenes, tmp_path, ray_two_cpus, monkeypatch, caplog
):
    from extraction import Detector, draw
    from storage import FeatureReader

    images = tmp_path / "images"
    images.mkdir()
    for path in sorted(scenes.images_dir.iterdir())[:3]:
        shutil.copy(path, images / path.name)
    store = tmp_path / "feats.lmdb"
    assert xmodal(_extract_argv(images, store, run_dir / "last")) == 0
    assert "RANDOM weights" not in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what each replica builds: no random-weights warning
        Detector.build(weights=run_dir / "last")

    reader = FeatureReader(store)
    provenance = reader.shards[0].read_meta()["provenance"]
    assert provenance["classes"] == list(SHAPES) and provenance["attributes"] == list(COLOURS)
    assert provenance["weights"] == str(run_dir / "last") and provenance["weights_sha256"]
    assert provenance["preset"] == "c4-small" and provenance["config"]["min_size"] == 64
    img_id = sorted(images.iterdir())[0]
    assert len(reader) == 3 and img_id.stem in reader

    drawings = []

    def keep(*args, **kwargs):
        drawings.append(draw_regions(*args, **kwargs))
        return drawings[-1]

    draw_regions = draw.draw_regions
    monkeypatch.setattr(draw, "draw_regions", keep)
    picture = tmp_path / "show.png"
    show = ["features", "show", str(store), img_id.stem, "--image", str(img_id), "--out", str(picture)]
    assert xmodal([*show, "--min-score", "0"]) == 0
    assert picture.is_file()
    texts = [label.text for label in drawings[0].labels if label.region >= 0]
    assert len(texts) == 3
    for text in texts:  # "attribute object confidence" in the run's own names, not attr2 obj1
        attribute, name, confidence = text.split()
        assert attribute in COLOURS and name in SHAPES and 0 <= float(confidence) <= 1, text


def test_a_store_records_the_preset_that_ran_once(run_dir):
    """Issue 45: a store made with a c4-small run directory said `preset: "c4-small"` beside
    `extract_settings.preset: "vg-r101-c4"` (the --preset default the directory overrides)."""
    from extraction import Detector
    from pipelines.jobs.extract.config import ExtractConfig, recorded_settings

    weights = run_dir / "last"
    provenance = Detector.build(weights=weights, min_boxes=3, max_boxes=3).provenance()
    cfg = ExtractConfig(inputs=["photos"], weights=str(weights), min_boxes=3, max_boxes=3)
    assert cfg.preset == "vg-r101-c4" and provenance["preset"] == "c4-small"
    recorded = recorded_settings(cfg, provenance)["preset"], recorded_settings(cfg, None)["preset"]
    assert recorded == ("c4-small", "c4-small")  # the store's, and a resumed job's to compare with
