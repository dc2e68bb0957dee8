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


def test_the_commands_block_and_long_paths_wrap_instead_of_widening_the_page(tmp_path: Path) -> None:
    long = "xmodal extract " + "/very/long/path" * 40
    text = write_report(ReportInputs(out_dir=tmp_path, summary=SUMMARY, commands=[long])).read_text()
    style = text[text.index("<style>") : text.index("</style>")]
    assert re.search(r"pre\{[^}]*white-space:pre-wrap", style)
    assert re.search(r"pre\{[^}]*overflow-wrap:anywhere", style)  # a path has no space to break at
    assert re.search(r"td,code\{[^}]*overflow-wrap:anywhere", style)


def test_four_loss_panels_are_drawn_two_a_row(tmp_path: Path) -> None:
    runs = {name: _metrics(tmp_path / f"{name}.jsonl", 5, {"mlm": 1.0}) for name in "abcd"}
    png = plot_curves(runs, tmp_path / "c.png")
    width, height = Image.open(png).size
    # a 1100-px page shows the picture at its own size: each panel about half of it, not a quarter
    assert width <= 1100 and height > 0.6 * width
    three = Image.open(plot_curves(dict(list(runs.items())[:3]), tmp_path / "c3.png")).size
    assert three == (width, height)  # the fourth cell left empty


# the demo's figures: every group has a bar near 100 %, where a legend inside the axes sat
DEMO_ACCURACY = {
    "accuracy": 92.9,
    "other_images_accuracy": 33.2,
    "prior_baseline_accuracy": 40.0,
    "baseline_accuracy": 21.9,
    "per_type_accuracy": {"how many": 80.0, "is the": 98.4, "what color is the": 94.4,
                          "what color is the shape on the": 100.0, "what shape is the": 86.8},
    "per_type_other_images": {"how many": 30.0, "is the": 55.0, "what color is the": 25.0,
                              "what color is the shape on the": 28.0, "what shape is the": 33.0},
    "per_type_prior_baseline": {"how many": 26.7, "is the": 58.2, "what color is the": 27.8,
                                "what color is the shape on the": 27.8, "what shape is the": 32.4},
    "per_type_baseline": {"how many": 5.0, "is the": 58.2, "what color is the": 27.8,
                          "what color is the shape on the": 27.8, "what shape is the": 2.0},
}  # fmt: skip


def _overlaps(fig) -> list:
    """The bars the figure's legend covers, in pixels as drawn."""
    from matplotlib.patches import Rectangle

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    bars = [p for ax in fig.axes for p in ax.patches if isinstance(p, Rectangle) and p.get_height() > 0]
    assert len(legends) == 1 and len(bars) == 4 * 6  # four series, overall and five question types
    box = legends[0].get_window_extent(renderer)
    return [bar for bar in bars if box.overlaps(bar.get_window_extent(renderer))]


def test_the_accuracy_legend_covers_no_bar() -> None:
    import matplotlib.pyplot as plt

    from pipelines.apps.demo.report import accuracy_figure

    fig = accuracy_figure(DEMO_ACCURACY)
    try:
        assert _overlaps(fig) == []
        # the check sees a legend inside the axes, where it used to be
        fig.legends.clear()
        fig.axes[0].legend(fontsize=8)
        assert _overlaps(fig)
    finally:
        plt.close(fig)


def test_the_pictures_say_which_regions_they_draw(tmp_path: Path, image: Path) -> None:
    """The detection pictures draw the regions at >= 0.5 labelled with confidence, the `ask` picture the
    most attended of all the stored regions labelled with attention: the page says so beside each."""
    explain = tmp_path / "explain.png"
    Image.new("RGB", (32, 32)).save(explain)
    rec = _record("img", [[4, 4, 20, 20]] * 10, [0.9] + [0.1] * 9)
    ask = AskResult(
        image=image, question="what color is the circle?", answers=[("red", 0.9)], explain_png=explain
    )
    text = write_report(
        ReportInputs(out_dir=tmp_path, summary=SUMMARY, detections=[(image, rec)], ask=ask)
    ).read_text()
    detections = text[text.index("<h2>Detections</h2>") : text.index("<h2>xmodal ask</h2>")]
    asked = text[text.index("<h2>xmodal ask</h2>") :]
    assert "Of the 10 regions stored per image" in detections and "at least 0.5 sure" in detections
    assert "confidence" in detections
    assert "all 10 stored regions" in asked and "below 0.5" in asked and "attention weight" in asked


CAPTION = {
    "metrics": {"CIDEr": 250.0, "Bleu_4": 70.0},
    "cider_d": 250.0,
    "baseline_cider_d": 20.0,
    "baseline_caption": "a yellow circle",
    "test_images": 45,
    "agreement": {
        "images": 45,
        "names_every_shape": 51.1,
        "by_shapes": {"1": 80.0, "2": 61.5, "3": 50.0, "4": 16.7},
        "images_by_shapes": {"1": 10, "2": 13, "3": 10, "4": 12},
    },
    "baseline_agreement": {
        "images": 45,
        "names_every_shape": 2.2,
        "by_shapes": {"1": 10.0, "2": 0.0, "3": 0.0, "4": 0.0},
        "images_by_shapes": {"1": 10, "2": 13, "3": 10, "4": 12},
    },
    "ask": {
        "image": "/w/data/images/synth_000012.png",
        "caption": "a red circle and a blue square",
        "truth": ["a red circle and a blue square."],
        "agrees": True,
    },
    "missed": {"image": "synth_000003", "caption": "a green circle", "truth": ["a green square."]},
}


def test_the_caption_section_leads_with_how_many_captions_name_their_scene(tmp_path: Path) -> None:
    text = write_report(ReportInputs(out_dir=tmp_path, summary={**SUMMARY, "caption": CAPTION})).read_text()
    headline = text[text.index("<h2>Headline</h2>") :]
    headline = headline[: headline.index("</table>")]
    assert "naming every shape&#x27;s colour and kind (45 test images) / constant caption" in headline
    assert "<td>51.1% / 2.2%</td>" in headline and "<td>250.0 / 20.0</td>" in headline
    section = text[text.index("<h2>Captioning (Up-Down)</h2>") :]
    assert section.index("51.1% of the 45 test captions name every shape") < section.index("CIDEr-D 250.0")
    assert "given to every test image, 2.2%" in section and "Places are left out" in section
    assert "<tr><th>4</th><td>12: 16.7%</td></tr>" in section
    assert "the most shapes whose evaluated caption names them all" in section
    assert "<b>a red circle and a blue square</b><br>reference: a red circle and a blue square." in section
    assert "<code>synth_000003</code>: <b>a green circle</b><br>reference: a green square." in section
    # no caption agrees: the page says the example is only the first test image
    worse = {**CAPTION, "ask": {**CAPTION["ask"], "agrees": False}}
    text = write_report(ReportInputs(out_dir=tmp_path, summary={**SUMMARY, "caption": worse})).read_text()
    assert "the first test image: no caption names its scene" in text


def test_the_caption_section_says_what_the_captioner_learned_from_the_run_s_figures(tmp_path: Path) -> None:
    """The demo's captions named colours and kinds but never counted (0 of 45 used a number, every scene
    with a repeated shape was wrong): the page must say so from those figures, not claim counted captions
    ("two red circles and a blue square") it never wrote."""
    figures = {"names_kinds": 71.1, "uses_a_count": 0.0, "repeated": {"images": 12, "named": 0.0},
               "distinct": {"images": 33, "named": 69.7}}  # fmt: skip
    uncounted = {**CAPTION["agreement"], **figures}
    caption = {**CAPTION, "agreement": uncounted}
    text = write_report(ReportInputs(out_dir=tmp_path, summary={**SUMMARY, "caption": caption})).read_text()
    section = text[text.index("<h2>Captioning (Up-Down)</h2>") :]
    assert "two red circles" not in section
    assert "Leaving the counts aside, 71.1% name the scene's colours and shapes" in section
    assert "0.0% of the captions use a number" in section
    assert "of the 12 test scenes holding a shape more than once, 0.0% are named right" in section
    assert "of the 33 whose shapes all differ 69.7%" in section and "it does not count" in section
    counted = {**uncounted, "uses_a_count": 40.0, "repeated": {"images": 12, "named": 75.0}}
    caption = {**CAPTION, "agreement": {**counted, "distinct": {"images": 33, "named": 70.0}}}
    text = write_report(ReportInputs(out_dir=tmp_path, summary={**SUMMARY, "caption": caption})).read_text()
    assert "it does not count" not in text and "counts included" in text


def test_the_probe_row_shows_what_the_features_tell_of_places(tmp_path: Path) -> None:
    probe = {"held_out_regions": 218, "shape_accuracy": 0.986, "colour_accuracy": 1.0, "row_accuracy": 0.651,
             "column_accuracy": 0.583}  # fmt: skip
    text = write_report(ReportInputs(out_dir=tmp_path, summary={**SUMMARY, "probe": probe})).read_text()
    assert "218 held-out regions: shape / colour / row / column" in text
    assert "<td>98.6% / 100.0% / 65.1% / 58.3%</td>" in text


def test_the_detector_curve_shows_ap_in_percent_as_the_table_does(tmp_path: Path, monkeypatch) -> None:
    """The report's detector table gives AP ×100; the curve of the same run's validation AP50 must too."""
    import matplotlib.figure

    figures = []
    real = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3)] + [{"step": 3, "valid_AP50": 0.42}]
    path = tmp_path / "det" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_curves({"detector": path}, tmp_path / "c.png") is not None
    (fig,) = figures
    (right,) = [ax for ax in fig.axes if "AP50" in ax.get_ylabel()]
    assert "%" in right.get_ylabel() and right.get_ylim() == (0, 100)
    (line,) = right.get_lines()
    assert list(line.get_ydata()) == [pytest.approx(42.0)]
