"""The demo report on placeholder inputs: pictures drawn, links resolve, the random-weights warning."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines.apps.demo.report import AskResult, ReportInputs, draw_detections, plot_curves, write_report
from storage import RegionFeatures


def _record(img_id: str, boxes: list[list[float]], conf: list[float]) -> RegionFeatures:
    n = len(boxes)
    return RegionFeatures(
        img_id=img_id,
        img_h=64,
        img_w=64,
        boxes=np.array(boxes, np.float32),
        features=np.zeros((n, 8), np.float32),
        objects_id=np.arange(n, dtype=np.int64),
        objects_conf=np.array(conf, np.float32),
        attrs_id=np.zeros(n, np.int64),
        attrs_conf=np.zeros(n, np.float32),
    )


@pytest.fixture()
def image(tmp_path: Path) -> Path:
    path = tmp_path / "img.png"
    Image.new("RGB", (64, 64), (40, 40, 40)).save(path)
    return path


def _metrics(path: Path, n: int, extra: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {"step": s, "loss": 3.0 / (s + 1), **{k: v / (s + 1) for k, v in extra.items()}} for s in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


SUMMARY = {
    "accuracy": 80.0,
    "other_images_accuracy": 45.5,
    "per_type_other_images": {"how many": 50.0, "what color is the": 41.0},
    "image_gain_points": 34.5,
    "baseline_accuracy": 20.0,
    "prior_baseline_accuracy": 40.0,
    "majority_answer": "left",
    "per_type_accuracy": {"how many": 90.0, "what color is the": 70.0},
    "per_type_baseline": {"how many": 0.0, "what color is the": 0.0},
    "per_type_prior_baseline": {"how many": 50.0, "what color is the": 25.0},
    "margin_points": 60.0,
    "beats_baseline_by_15": True,
    "elapsed_s": 12.0,
    "stage_s": {"extract": 3.0},
    "detector_weights": "random",
}


def test_only_the_most_confident_boxes_are_drawn(tmp_path: Path, image: Path) -> None:
    rec = _record("x", [[4, 4, 20, 20], [30, 30, 60, 60]], [0.3, 0.9])
    drawing = draw_detections(image, rec, tmp_path / "one.png", top=1)
    drawn = np.asarray(Image.open(tmp_path / "one.png").convert("RGB")).astype(int)
    assert np.array_equal(drawn[..., ::-1], drawing.image)  # the PNG is the returned picture
    assert drawn.shape == (600, 600, 3)  # a 64 px image enlarged to a legible size
    k = 600 / 64
    background = np.array([40, 40, 40])
    # the outline of the confident box is drawn, the other box's left edge is untouched
    assert np.abs(drawn[round(45 * k), round(30 * k)] - background).sum() > 100
    assert np.abs(drawn[round(12 * k), round(4 * k)] - background).sum() == 0
    assert [(lb.region, lb.text) for lb in drawing.labels] == [(1, "attr0 obj1 0.90")]
    both = draw_detections(image, rec, tmp_path / "two.png", top=2)
    assert np.abs(both.image[round(12 * k), round(4 * k)].astype(int) - background).sum() > 100
    assert [lb.region for lb in both.labels] == [1, 0]  # most confident first


@pytest.mark.parametrize("size", [(24, 32), (96, 96), (640, 480), (2000, 3000)])
def test_detection_pictures_are_legible_at_any_size(tmp_path: Path, size, assert_legible) -> None:
    h, w = size
    rng = np.random.default_rng(h)
    xy = rng.uniform(0, 0.7, (36, 2)) * [w, h]
    boxes = np.concatenate([xy, xy + rng.uniform(0.05, 0.3, (36, 2)) * [w, h]], axis=1)
    rec = _record("x", boxes.tolist(), rng.uniform(0, 1, 36).tolist())
    rec.img_h, rec.img_w = h, w
    path = tmp_path / "img.png"
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    drawing = draw_detections(path, rec, tmp_path / "d.png", top=10)
    assert_legible(drawing, size)
    assert len(drawing.labels) == 10


def test_curves_skip_missing_runs_and_plot_task_losses(tmp_path: Path) -> None:
    assert plot_curves({"none": tmp_path / "absent.jsonl"}, tmp_path / "c.png") is None
    pre = _metrics(tmp_path / "pre" / "metrics.jsonl", 5, {"mlm": 2.0, "matched": 0.7})
    png = plot_curves({"pre": pre, "absent": tmp_path / "absent.jsonl"}, tmp_path / "c.png")
    assert png is not None and Image.open(png).size[0] > 100


def _image_links(report: Path) -> list[Path]:
    return [report.parent / src for src in re.findall(r'<img src="([^"]+)"', report.read_text())]


def test_report_links_resolve_and_warn_about_random_weights(tmp_path: Path, image: Path) -> None:
    explain = tmp_path / "explain.png"
    Image.new("RGB", (32, 32)).save(explain)
    report = write_report(
        ReportInputs(
            out_dir=tmp_path,
            summary=SUMMARY,
            detections=[(image, _record("img", [[4, 4, 20, 20]], [0.5]))],
            curves={
                "pre-training": _metrics(tmp_path / "pre.jsonl", 4, {"mlm": 1.0}),
                "VQA": _metrics(tmp_path / "vqa.jsonl", 4, {}),
            },
            ask=AskResult(
                image=image,
                question="what color is the <b>?",
                answers=[("red", 0.9)],
                truth="red",
                explain_png=explain,
            ),
            commands=["xmodal pretrain --preset tiny", "xmodal ask img.png 'what <b>?'"],
        )
    )
    text = report.read_text()
    assert "RANDOM DETECTOR WEIGHTS" in text
    assert "<pre>xmodal pretrain --preset tiny\nxmodal ask img.png &#x27;what &lt;b&gt;?&#x27;</pre>" in text
    assert "what color is the &lt;b&gt;?" in text and "<b>?" not in text
    assert "80.0%" in text and "20.0%" in text and "+60.0 points" in text
    links = _image_links(report)
    assert len(links) == 4  # accuracy, curves, one detection picture, the attention picture
    for link in links:
        assert link.is_file() and Image.open(link).format == "PNG"


def test_the_headline_table_shows_the_runs_own_figures(tmp_path: Path) -> None:
    summary = {
        **SUMMARY,
        "detector_weights": "/runs/detector/best",
        "detector_trained": True,
        "detector": {"AP": 0.5, "AP50": 0.925, "attr_acc": 1.0, "APl": None},
        "probe": {"held_out_regions": 12, "shape_accuracy": 0.75, "colour_accuracy": 1.0},
        "per_type_accuracy": {"how many": 64.0},
        "per_type_prior_baseline": {"how many": 26.5},
    }
    text = write_report(ReportInputs(out_dir=tmp_path, summary=summary)).read_text()
    headline = text[text.index("<h2>Headline</h2>") :]
    headline = headline[: headline.index("</table>")]
    assert "<td>92.5% / 50.0%</td>" in headline  # detector AP50 / AP
    assert "12 held-out regions" in headline and "<td>75.0% / 100.0%</td>" in headline
    assert "<td>64.0% / 26.5%</td>" in headline  # a question type against its prior
    assert "RANDOM DETECTOR WEIGHTS" not in text and "trained here" in text
    assert "<th>APl</th><td>n/a</td>" in text  # no large box in the held-out scenes


def test_real_weights_drop_the_warning_and_a_miss_is_reported(tmp_path: Path) -> None:
    summary = {**SUMMARY, "detector_weights": "/w/faster_rcnn_from_caffe_attr.pkl", "accuracy": 30.0,
               "margin_points": 10.0, "beats_baseline_by_15": False}  # fmt: skip
    text = write_report(ReportInputs(out_dir=tmp_path, summary=summary)).read_text()
    assert "RANDOM DETECTOR WEIGHTS" not in text and "faster_rcnn_from_caffe_attr.pkl" in text
    assert "misses the +15 point bar" in text


def test_report_shows_how_much_the_image_matters(tmp_path: Path) -> None:
    text = write_report(ReportInputs(out_dir=tmp_path, summary=SUMMARY)).read_text()
    section = text[text.index("<h2>Does the model use the image?</h2>") :]
    section = section[: section.index("<h2>", 5)]
    cells = re.findall(r"<tr><th>([^<]*)</th><td>([^<]*)</td></tr>", section)
    assert [value for _, value in cells] == ["80.0%", "45.5%", "40.0%", "20.0%"]
    assert "another test image&#x27;s regions" in cells[1][0]
    assert "+34.5 points" in section
    # a summary without the comparison (an older demo) leaves the section out
    older = {k: v for k, v in SUMMARY.items() if "other_images" not in k and k != "image_gain_points"}
    assert "Does the model use the image?" not in write_report(ReportInputs(tmp_path, older)).read_text()


def test_pictures_are_read_through_the_image_checks(tmp_path: Path) -> None:
    import os

    from extraction import ImageError

    rec = _record("x", [[4, 4, 20, 20]], [0.9])
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    with pytest.raises(ImageError, match="named pipe"):  # refused at once: reading it would hang
        draw_detections(fifo, rec, tmp_path / "out.png")
    bomb = tmp_path / "bomb.png"
    Image.new("1", (8000, 8000)).save(bomb)
    with pytest.raises(ImageError, match="MP limit"):
        draw_detections(bomb, rec, tmp_path / "out.png")
