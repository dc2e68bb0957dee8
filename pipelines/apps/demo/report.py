"""The demo's report: `report.html` with a headline table, PNGs of detections, loss curves, accuracy, one
`xmodal ask`, the detector's box AP, and the captioner's scores and attention over time."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from extraction.draw import Drawing
from storage import RegionFeatures

TASK_LOSSES = ("mlm", "matched", "obj", "attr", "feat", "qa")
DRAWN_CONFIDENCE = 0.5  # detection pictures show the regions the detector is this sure of
CURVE_COLUMNS = 2


@dataclass
class AskResult:
    """One `xmodal ask`: the question, its top answers with scores, and the attention picture if drawn."""

    image: Path
    question: str
    answers: list[tuple[str, float]]
    truth: str | None = None
    explain_png: Path | None = None


@dataclass
class ReportInputs:
    """Everything the report shows; paths may be missing (that stage did not run) and are then left out."""

    out_dir: Path
    summary: Mapping
    detections: Sequence[tuple[Path, RegionFeatures]] = ()
    curves: Mapping[str, Path] = field(default_factory=dict)  # run name -> metrics.jsonl
    ask: AskResult | None = None
    caption_png: Path | None = (
        None  # `xmodal ask --caption --explain`'s picture; scores in summary["caption"]
    )
    object_names: Sequence[str] | None = None
    attr_names: Sequence[str] | None = None
    commands: Sequence[str] = ()


def draw_detections(
    image_path: Path,
    rec: RegionFeatures,
    out_png: Path,
    top: int = 10,
    names: Sequence[str] | None = None,
    attr_names: Sequence[str] | None = None,
    min_conf: float = 0.0,
) -> Drawing:
    """The `top` most confident regions of `rec` over its image (those at `min_conf` or above, and at least
    the best one), labelled "attribute object confidence", at a legible size (small images enlarged);
    written to `out_png`."""
    import cv2

    from extraction import load_image
    from extraction.draw import draw_regions

    order = np.argsort(-rec.objects_conf, kind="stable")[:top]
    order = order[: max(1, int((rec.objects_conf[order] >= min_conf).sum()))]
    objects = list(names) if names is not None else None
    attributes = list(attr_names) if attr_names is not None else None
    drawing = draw_regions(load_image(image_path), rec, objects, attributes, regions=order, show_conf=True)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(out_png), drawing.image)
    return drawing


def _read_metrics(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def plot_curves(curves: Mapping[str, Path], out_png: Path) -> Path | None:
    """Training loss, each task's loss and the validation loss against step, one panel per run, two panels a
    row; None if nothing was logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: _read_metrics(Path(p)) for name, p in curves.items() if Path(p).is_file()}
    runs = {name: rows for name, rows in runs.items() if any("loss" in r or "valid_loss" in r for r in rows)}
    if not runs:
        return None
    # two panels a row: a page-wide strip of four leaves each panel too small to read
    columns = min(len(runs), CURVE_COLUMNS)
    rows_of_panels = -(-len(runs) // columns)
    fig, axes = plt.subplots(
        rows_of_panels, columns, figsize=(5.5 * columns, 4.2 * rows_of_panels), squeeze=False
    )
    for ax in axes.flat[len(runs) :]:
        ax.set_visible(False)
    for ax, (name, rows) in zip(axes.flat, runs.items(), strict=False):
        # the tasks' losses, and the detector's loss_rpn_cls, loss_cls, ...
        tasks = sorted({k for r in rows for k in r if k in TASK_LOSSES or k.startswith("loss_")})
        ap = [(r["step"], r["valid_AP50"]) for r in rows if isinstance(r.get("valid_AP50"), (int, float))]
        if ap:  # the detector's validation AP50 on its own axis, in percent as the report's table shows it
            right = ax.twinx()
            steps, values = zip(*ap, strict=True)
            percent = [100 * v for v in values]
            right.plot(steps, percent, color="tab:green", marker="o", label="valid AP50 (%)")
            right.set_ylim(0, 100)
            right.set_ylabel("validation AP50 (%)", color="tab:green")
        for key, style in (
            [("loss", dict(color="black", linewidth=2))]
            + [(k, dict(linewidth=1)) for k in tasks]
            + [("valid_loss", dict(color="black", linestyle="--", linewidth=1.5))]
        ):
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=key, marker=".", **style)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def accuracy_figure(summary: Mapping):
    """Held-out accuracy next to the same model given other images' regions and the baselines, overall
    and per question type; the legend below the axes, where it covers no bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {
        "fine-tuned LXMERT": ("accuracy", "per_type_accuracy", "tab:blue"),
        "same model, another image's regions": ("other_images_accuracy", "per_type_other_images", "tab:cyan"),
        "question-type prior": ("prior_baseline_accuracy", "per_type_prior_baseline", "tab:orange"),
        "majority answer": ("baseline_accuracy", "per_type_baseline", "tab:grey"),
    }
    series = {k: v for k, v in series.items() if v[0] in summary}
    groups = ["overall"] + sorted(summary.get("per_type_accuracy", {}))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups)), 4.6))
    for k, (label, (overall_key, per_type_key, colour)) in enumerate(series.items()):
        per_type = summary.get(per_type_key, {})
        values = [summary.get(overall_key, np.nan)] + [per_type.get(g, np.nan) for g in groups[1:]]
        xs = np.arange(len(groups)) + (k - (len(series) - 1) / 2) * width
        ax.bar(xs, [float(v) for v in values], width, label=label, color=colour)
    ax.set_xticks(np.arange(len(groups)), groups, fontsize=8, rotation=15, ha="right")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(axis="y", alpha=0.3)
    if series:
        fig.legend(loc="lower center", ncols=min(len(series), 4), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def plot_accuracy(summary: Mapping, out_png: Path) -> Path:
    """`accuracy_figure` written to `out_png`."""
    import matplotlib.pyplot as plt

    fig = accuracy_figure(summary)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def _img(path: Path, root: Path, alt: str) -> str:
    rel = Path(path).resolve().relative_to(root.resolve())
    return f'<img src="{html.escape(rel.as_posix())}" alt="{html.escape(alt)}">'


def _pct(value) -> str:
    return f"{float(value):.1f}%" if isinstance(value, (int, float)) else "n/a"


def _table(rows: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _image_matters(s: Mapping) -> str:
    """The four held-out numbers side by side, and what their differences say about the picture's part."""
    rows = [
        ("each question with its own image's regions", _pct(s.get("accuracy"))),
        ("the same model, each question with another test image's regions", _pct(s["other_images_accuracy"])),
        ("question-type prior (no image)", _pct(s.get("prior_baseline_accuracy"))),
        ("majority answer (no image, no question)", _pct(s.get("baseline_accuracy"))),
    ]
    gain = float(s.get("image_gain_points", float(s.get("accuracy", 0)) - float(s["other_images_accuracy"])))
    return (
        "<h2>Does the model use the image?</h2><p>Held-out accuracy of one model, with the right and with "
        "the wrong picture, beside two answers that never look at one:</p>"
        + _table(rows)
        + f"<p>The right image's regions are worth {gain:+.1f} points over another image's. Accuracy that "
        "survives the wrong image comes from the question alone; near the question-type prior, that is "
        "all the model learned.</p>"
    )


def _headline(s: Mapping) -> str:
    """One table of the run's own figures: detector AP50, VQA against both priors (overall and per question
    type), with another image's regions, and caption CIDEr-D against the constant caption."""
    rows = []
    if s.get("detector"):
        d = s["detector"]
        rows.append(
            ("detector box AP50 / AP (held-out scenes)", f"{_pct(100 * d['AP50'])} / {_pct(100 * d['AP'])}")
        )
    probe = s.get("probe") or {}
    if "shape_accuracy" in probe:
        probed = [k for k in ("shape", "colour", "row", "column") if f"{k}_accuracy" in probe]
        rows.append((
            f"linear probe on {probe['held_out_regions']} held-out regions: {' / '.join(probed)}",
            " / ".join(_pct(100 * probe[f"{k}_accuracy"]) for k in probed),
        ))  # fmt: skip
    figures = [_pct(s.get(k)) for k in ("accuracy", "prior_baseline_accuracy", "baseline_accuracy")]
    rows.append(("VQA accuracy / question-type prior / majority answer", " / ".join(figures)))
    prior = s.get("per_type_prior_baseline", {})
    for kind, acc in s.get("per_type_accuracy", {}).items():
        rows.append((f"  “{kind} …” / its prior", f"{_pct(acc)} / {_pct(prior.get(kind))}"))
    if "other_images_accuracy" in s:
        rows.append(("VQA accuracy with another image's regions", _pct(s["other_images_accuracy"])))
    c = s.get("caption")
    if c and "agreement" in c:
        shares = [_pct(c[k]["names_every_shape"]) for k in ("agreement", "baseline_agreement")]
        rows.append((
            f"captions naming every shape's colour and kind ({c['test_images']} test images) / constant "
            "caption",
            " / ".join(shares),
        ))  # fmt: skip
    if c:
        rows.append(
            (
                "caption CIDEr-D / constant caption",
                f"{float(c['cider_d']):.1f} / {float(c['baseline_cider_d']):.1f}",
            )
        )
    return "<h2>Headline</h2>" + _table(rows)


def _caption_section(c: Mapping, picture: Path | None, root: Path) -> list[str]:
    """Captioning: how many test captions name their scene, CIDEr-D against the constant-caption baseline,
    `xmodal evaluate`'s metrics, the example `ask` captioned and the first caption that misses."""
    parts = ["<h2>Captioning (Up-Down)</h2>"]
    agreement = c.get("agreement")
    if agreement:
        share, base = agreement["names_every_shape"], c["baseline_agreement"]["names_every_shape"]
        parts.append(
            f"<p class='{'ok' if share > base else 'bad'}'>{_pct(share)} of the {agreement['images']} test "
            "captions name every shape's colour and kind, as many times as the scene holds it, and no shape "
            f"the scene lacks; the most frequent training description, given to every test image, "
            f"{_pct(base)}. {_what_it_learns(agreement)}Places are left out of the descriptions: the "
            "captioner does not read the boxes, and the regions' features hardly tell where a shape lies "
            "(the linear probe's row and column, above).</p>"
        )
        parts.append(
            _table(
                [("shapes in the scene", "test images: captions naming them all")]
                + [
                    (n, f"{agreement['images_by_shapes'][n]}: {_pct(share)}")
                    for n, share in agreement["by_shapes"].items()
                ]
            )
        )
    parts += [
        f"<p>Test CIDEr-D {float(c['cider_d']):.1f} vs {float(c['baseline_cider_d']):.1f} for the most "
        f"frequent training caption given to every test image (<i>{html.escape(str(c['baseline_caption']))}"
        f"</i>), on {c['test_images']} test images. CIDEr-D counts n-grams shared with the reference, so a "
        "caption with a wrong colour still scores; the share above counts only captions that are right.</p>",
        "<p><code>xmodal evaluate caption</code> (×100; skipped metrics are named in its log):</p>",
        _table([(name, f"{float(v):.2f}") for name, v in c["metrics"].items()]),
    ]
    ask = c.get("ask")
    if ask:
        truth = "<br>".join(html.escape(t) for t in ask["truth"])
        if "agrees" in ask:
            chosen = (
                "the test image with the most shapes whose evaluated caption names them all (the lowest "
                "id among ties)"
                if ask["agrees"]
                else "the first test image: no caption names its scene"
            )
            parts.append(f"<p>The example is {chosen}.</p>")
        parts.append(
            f"<p><code>xmodal ask {html.escape(Path(ask['image']).name)} --caption</code>: "
            f"<b>{html.escape(ask['caption'])}</b><br>reference: {truth}</p>"
        )
    missed = c.get("missed")
    if missed:
        parts.append(
            f"<p>The first test caption (by image id) that does not name its scene, "
            f"<code>{html.escape(missed['image'])}</code>: <b>{html.escape(missed['caption'])}</b><br>"
            f"reference: {'<br>'.join(html.escape(t) for t in missed['truth'])}</p>"
        )
    if picture is not None and Path(picture).is_file():
        parts.append(
            "<p>Attention over time (each word's attended regions):</p>" + _img(picture, root, "caption")
        )
    return parts


def _what_it_learns(a: Mapping) -> str:
    """What the captioner learned, read off the test captions' figures (nothing claimed that they do not
    show): the colours and shapes leaving counts aside, how often it counts, and the scenes that need it."""
    if "names_kinds" not in a:  # a summary written before these figures were kept
        return ""
    rep, dist = a["repeated"], a["distinct"]
    text = (
        f"Leaving the counts aside, {_pct(a['names_kinds'])} name the scene's colours and shapes. "
        f"{_pct(a['uses_a_count'])} of the captions use a number"
    )
    if rep["images"]:
        text += (
            f"; of the {rep['images']} test scenes holding a shape more than once, {_pct(rep['named'])} are "
            "named right"
        )
        if dist["images"]:
            text += f", of the {dist['images']} whose shapes all differ {_pct(dist['named'])}"
    text += ". "
    if a["uses_a_count"] == 0:
        return text + (
            "So it learns which colours and shapes a scene holds, and names a repeated one once: it does not "
            "count. "
        )
    if rep["images"] and dist["images"] and rep["named"] < dist["named"]:
        return text + "So it counts, but a repeated shape is named right less often than shapes that differ. "
    return text + "So it learns each scene's description, counts included. "


def _regions(inputs: ReportInputs) -> str:
    """How many regions each image has in the store, as the pictures' captions say it."""
    if inputs.detections:
        return str(inputs.detections[0][1].num_boxes)
    return str(inputs.summary.get("config", {}).get("boxes", "the"))


def write_report(inputs: ReportInputs) -> Path:
    """Draw the pictures into `out_dir/report/` and write `out_dir/report.html`; returns its path."""
    root = inputs.out_dir
    pics = root / "report"
    s = inputs.summary
    parts: list[str] = [
        "<!doctype html><html><head><meta charset='utf-8'><title>xmodal demo report</title><style>"
        "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
        "img{max-width:100%;margin:4px;border:1px solid #ccc}"
        ".warn{background:#fff3cd;border:2px solid #e0a800;padding:1em;font-weight:bold}"
        ".ok{background:#e8f5e9;border:1px solid #66bb6a;padding:.6em}.bad{background:#fdecea;"
        "border:1px solid #e57373;padding:.6em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}code{background:#f4f4f4}"
        # long paths and command lines wrap instead of widening the page
        "pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f4f4f4;padding:.5em}"
        "td,code{overflow-wrap:anywhere}"
        "</style></head><body><h1>xmodal demo report</h1>"
    ]
    parts.append(_headline(s))
    if s.get("detector_weights", "random") == "random":
        parts.append(
            "<p class='warn'>RANDOM DETECTOR WEIGHTS: the Faster R-CNN ran with fixed-seed random weights. "
            "Its boxes, labels and features carry no learned meaning; whatever the model learned here it "
            "learned from raw, randomly projected pixels. Train a detector (<code>xmodal detector "
            "train</code>) or pass released weights.</p>"
        )
    elif s.get("detector_trained"):
        parts.append(
            "<p>The detector was trained here, on the training scenes' own boxes (shapes as object classes, "
            f"colours as attributes): <code>{html.escape(str(s['detector_weights']))}</code>.</p>"
        )
    else:
        parts.append(f"<p>Detector weights: <code>{html.escape(str(s['detector_weights']))}</code></p>")

    margin = s.get("margin_points")
    verdict = s.get("beats_baseline_by_15")
    if margin is not None:
        cls = "ok" if verdict else "bad"
        parts.append(
            f"<p class='{cls}'>Held-out accuracy {_pct(s.get('accuracy'))} vs majority-answer baseline "
            f"{_pct(s.get('baseline_accuracy'))}: {float(margin):+.1f} points "
            f"({'meets' if verdict else 'misses'} the +15 point bar). The question-type prior (each "
            f"type's most common training answer, no image) scores {_pct(s.get('prior_baseline_accuracy'))}: "
            f"only the model's margin over it ({float(s.get('margin_over_prior_points', 0)):+.1f} points) "
            "can come from the image features.</p>"
        )
    if "other_images_accuracy" in s:
        parts.append(_image_matters(s))
    rows = [
        ("accuracy (test)", _pct(s.get("accuracy"))),
        ("same model, another test image's regions", _pct(s.get("other_images_accuracy"))),
        (
            "majority-answer baseline",
            f"{_pct(s.get('baseline_accuracy'))}, always {s.get('majority_answer')!r}",
        ),
        ("question-type prior baseline", _pct(s.get("prior_baseline_accuracy"))),
        ("test questions", str(s.get("test_questions", "n/a"))),
        ("images (train/valid/test)", str(s.get("images", "n/a"))),
        ("seed", str(s.get("seed", "n/a"))),
        ("elapsed", f"{float(s.get('elapsed_s', 0)):.0f} s"),
    ]
    rows += [(f"stage: {k}", f"{float(v):.1f} s") for k, v in s.get("stage_s", {}).items()]
    parts.append("<h2>Summary</h2>" + _table(rows))

    acc_png = plot_accuracy(s, pics / "accuracy.png")
    parts.append("<h2>Accuracy vs baselines</h2>" + _img(acc_png, root, "accuracy vs baselines"))

    curves_png = plot_curves(inputs.curves, pics / "loss_curves.png")
    if curves_png is not None:
        parts.append("<h2>Loss curves</h2>" + _img(curves_png, root, "loss curves"))

    if s.get("detector"):
        parts.append(
            "<h2>Detector (held-out scenes)</h2><p><code>xmodal detector evaluate</code>: COCO box AP "
            "(pycocotools) and the accuracy of the colour predicted on each true box (×100).</p>"
            + _table([(k, _pct(100 * v) if isinstance(v, (int, float)) else "n/a")
                      for k, v in s["detector"].items() if k not in ("weights", "annotations", "images")])
        )  # fmt: skip
    if inputs.detections:
        parts.append(
            f"<h2>Detections</h2><p>Of the {_regions(inputs)} regions stored per image, those the detector "
            f"is at least {DRAWN_CONFIDENCE} sure of (the best one at least), each labelled "
            "<i>colour shape confidence</i> with the detector's own class and attribute names.</p>"
        )
        for image_path, rec in inputs.detections:
            png = pics / f"detections_{rec.img_id}.png"
            draw_detections(
                image_path,
                rec,
                png,
                names=inputs.object_names,
                attr_names=inputs.attr_names,
                min_conf=DRAWN_CONFIDENCE,
            )
            parts.append(_img(png, root, f"detections on {rec.img_id}"))

    if inputs.ask is not None:
        a = inputs.ask
        truth = f" (truth: <b>{html.escape(a.truth)}</b>)" if a.truth else ""
        parts.append(
            f"<h2>xmodal ask</h2><p>Image <code>{html.escape(a.image.name)}</code>, question "
            f"<b>{html.escape(a.question)}</b>{truth}</p>"
        )
        parts.append(_table([(ans, f"{score:.3f}") for ans, score in a.answers]))
        if a.explain_png is not None and Path(a.explain_png).is_file():
            picture = _img(a.explain_png, root, "attention")
            parts.append(
                f"<p>The regions the answer attended to most, drawn from all {_regions(inputs)} stored "
                f"regions whatever the detector's confidence (the detection pictures above leave out those "
                f"below {DRAWN_CONFIDENCE}). Each box is labelled <i>#rank attention weight</i>, not "
                "confidence; the list above the image names each region by the detector's likeliest colour "
                "and shape, which for a region it is unsure of may name none of the scene's shapes.</p>"
                + picture
            )

    if s.get("caption"):
        parts += _caption_section(s["caption"], inputs.caption_png, root)

    if inputs.commands:
        cmds = "\n".join(html.escape(c) for c in inputs.commands)
        parts.append(
            "<h2>Commands run</h2><p>One line per stage, in order: paste a line into a shell to rerun "
            "that stage on the files it read here. Training refuses an <code>--out</code> that already "
            f"holds a run; give another <code>--out</code> to repeat it.</p><pre>{cmds}</pre>"
        )
    parts.append("</body></html>")
    out = root / "report.html"
    out.write_text("\n".join(parts))
    return out
