"""The whole pipeline on generated scenes: detector training -> Ray extraction -> LMDB -> pre-train -> VQA,
captions -> report."""

from __future__ import annotations

import json
import logging
import random
import shlex
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipelines.apps.demo.caption_facts import agreeing_example, caption_agreement, names_scene
from pipelines.apps.demo.probe import linear_probe
from pipelines.apps.demo.synthetic import Scene, SyntheticConfig, SyntheticDataset, generate, load_scenes

log = logging.getLogger(__name__)

MARGIN_BAR = 15.0  # points above the majority-answer baseline the demo promises


class DemoError(RuntimeError):
    """A stage of the demo failed; the message names the stage and the command to rerun by hand."""


@dataclass
class DemoConfig:
    """Sizes chosen so the demo runs in minutes on 2 CPU cores, its own detector trained first."""

    workdir: Path = Path("demo_run")
    seed: int = 0
    images: int = 300
    weights: str | None = None  # a released detector instead of training one (then at toy scale, below)
    image_size: int = 128
    max_shapes: int = 4
    # the c4-small detector on the scenes' own boxes (shapes as classes, colours as attributes)
    detector_steps: int = 800
    detector_lr: float = 2e-3
    boxes: int = 10
    # with --weights, the R101 at toy scale: its res5 head costs ~proposals x pooler^2, the bulk of CPU time
    proposals: int = 12
    pooler_resolution: int = 5
    extract_batch_size: int = 8
    pretrain_steps: int = 1200
    pretrain_lr: float = 5e-4
    finetune_steps: int = 2400  # accuracy was still rising at 1600
    finetune_lr: float = 1e-3
    caption_steps: int = 300
    caption_lr: float = 2e-3
    batch_size: int = 32
    log_every: int = 10
    eval_every: int = 50
    overrides: list[str] = field(default_factory=list)  # extra key=value for pretrain and finetune

    @classmethod
    def quick(cls, **kw) -> DemoConfig:
        """A few dozen images and steps: checks that every stage runs, not that anything is learned."""
        base = dict(images=60, pretrain_steps=6, finetune_steps=10, caption_steps=6, batch_size=8, boxes=6,
                    proposals=8, log_every=2, eval_every=5, detector_steps=400)  # fmt: skip
        return cls(**{**base, **kw})


DEMO_MARKER = ".xmodal-demo"


@dataclass
class _Paths:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def features(self) -> Path:
        return self.root / "features.lmdb"

    @property
    def detector(self) -> Path:
        return self.root / "runs" / "detector"

    @property
    def detector_metrics(self) -> Path:
        return self.root / "runs" / "detector" / "test_metrics.json"

    @property
    def pretrain(self) -> Path:
        return self.root / "runs" / "pretrain"

    @property
    def vqa(self) -> Path:
        return self.root / "runs" / "vqa"

    @property
    def predictions(self) -> Path:
        return self.root / "runs" / "vqa" / "test_predictions.json"

    @property
    def other_image_predictions(self) -> Path:
        return self.root / "runs" / "vqa" / "test_predictions_other_images.json"

    @property
    def marker(self) -> Path:
        return self.root / DEMO_MARKER

    def claim(self) -> None:
        """Make the work folder the demo's own, or check that an earlier demo made it: a demo only ever
        deletes inside a folder holding its marker, never a user's folder that happens to be named."""
        if self.root.exists() and not self.root.is_dir():
            raise DemoError(f"--workdir {self.root} is a file; give a folder")
        if self.root.is_dir() and not self.marker.is_file() and any(self.root.iterdir()):
            raise DemoError(
                f"--workdir {self.root} is not empty and was not made by `xmodal demo` (no {DEMO_MARKER}); "
                "the demo would replace its data/, runs/ and report: give a new or empty folder"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self.marker.write_text("made by `xmodal demo`: it replaces its own outputs here on the next run\n")

    @property
    def caption(self) -> Path:
        return self.root / "runs" / "caption"

    @property
    def captions(self) -> Path:
        return self.root / "runs" / "caption" / "test_captions.json"

    def outputs(self) -> list[Path]:
        """Everything a demo writes; a new demo removes these first (stored ids from another seed would
        otherwise be skipped by extraction's resume and pair old features with new images)."""
        names = ("data", "features.lmdb", "features.errors.jsonl", "features.summary.json", "runs", "report",
                 "report.html", "summary.json")  # fmt: skip
        return [self.root / n for n in names]


class _Stages:
    """Runs `xmodal` subcommands in this process through the CLI parser, timing each and keeping the
    command lines, so the report lists commands that rerun each stage exactly."""

    def __init__(self, xmodal: Callable[[list[str]], int]) -> None:
        self.run_command = xmodal
        self.seconds: dict[str, float] = {}
        self.commands: list[str] = []

    def timed(self, name: str, fn: Callable[[], object]) -> object:
        start = time.perf_counter()
        log.info("demo: %s", name)
        try:
            return fn()
        finally:
            self.seconds[name] = round(time.perf_counter() - start, 2)

    def xmodal(self, name: str, argv: list[str], threads: int | None = None) -> None:
        """`xmodal ARGV` in-process, with `threads` intra-op torch threads if given (shown as the
        OMP_NUM_THREADS that does the same from a shell). Raises DemoError on a non-zero exit."""
        import torch

        env = [f"OMP_NUM_THREADS={threads}"] if threads else []
        line = shlex.join([*env, "xmodal", *argv])
        self.commands.append(line)
        before = torch.get_num_threads()
        try:
            if threads:
                torch.set_num_threads(threads)
            code = self.timed(name, lambda: self.run_command(argv))
        finally:
            torch.set_num_threads(before)
        if code:
            raise DemoError(f"demo stage {name!r} failed with exit status {code}; rerun it alone: {line}")


def _answer(label: dict) -> str:
    return max(label.items(), key=lambda kv: kv[1])[0]


def _score(label: dict, answer: str | None) -> float:
    return float(label.get(answer, 0.0)) if answer is not None else 0.0


def baselines(train_rows: list[dict], test_rows: list[dict]) -> dict:
    """The training questions' majority answer, overall and per question type, scored (%) on the test set."""
    majority = Counter(_answer(r["label"]) for r in train_rows).most_common(1)[0][0]
    by_type: dict[str, Counter] = defaultdict(Counter)
    for r in train_rows:
        by_type[r["question_type"]][_answer(r["label"])] += 1
    prior = {t: c.most_common(1)[0][0] for t, c in by_type.items()}
    return {
        "majority_answer": majority,
        "baseline_accuracy": _mean([_score(r["label"], majority) for r in test_rows]),
        "prior_baseline_accuracy": _mean(
            [_score(r["label"], prior.get(r["question_type"])) for r in test_rows]
        ),
        "per_type_baseline": _per_type(test_rows, lambda r: majority),
        "per_type_prior_baseline": _per_type(test_rows, lambda r: prior.get(r["question_type"])),
    }


def _mean(values: list[float]) -> float:
    """Mean soft score in percent (as `xmodal evaluate` reports accuracy)."""
    return round(100 * sum(values) / len(values), 2) if values else 0.0


def _per_type(rows: list[dict], predict: Callable[[dict], str | None]) -> dict[str, float]:
    scores: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        scores[r["question_type"]].append(_score(r["label"], predict(r)))
    return {t: _mean(v) for t, v in sorted(scores.items())}


def score_predictions(predictions: Path, test_rows: list[dict]) -> dict:
    """VQA soft accuracy (%) of a `[{question_id, answer}]` file, overall and per question type."""
    answers = {p["question_id"]: p["answer"] for p in json.loads(predictions.read_text())}
    missing = [r["question_id"] for r in test_rows if r["question_id"] not in answers]
    if missing:
        raise DemoError(f"{predictions} has no answer for {len(missing)} test questions, e.g. {missing[:5]}")
    return {
        "accuracy": _mean([_score(r["label"], answers[r["question_id"]]) for r in test_rows]),
        "per_type_accuracy": _per_type(test_rows, lambda r: answers[r["question_id"]]),
    }


def with_other_images(rows: list[dict], seed: int) -> list[dict]:
    """The rows with each image id replaced by another image id of the same rows: a seeded permutation of
    the distinct ids that leaves none in place (shuffled, then each id mapped to the next), so every
    question is asked about regions that are not its image's."""
    ids = sorted({r["img_id"] for r in rows})
    if len(ids) < 2:
        raise DemoError(f"{len(ids)} held-out image(s): swapping images between questions needs 2 or more")
    random.Random(seed).shuffle(ids)
    other = dict(zip(ids, ids[1:] + ids[:1], strict=True))
    return [{**r, "img_id": other[r["img_id"]]} for r in rows]


DETECTOR_PRESET = "c4-small"


def _detector_weights(cfg: DemoConfig, paths: _Paths) -> str:
    """The detector the demo extracts with: the one it trained, or the checkpoint it was given."""
    return cfg.weights or str(paths.detector / "best")


def _train_detector(stages: _Stages, cfg: DemoConfig, data: SyntheticDataset, paths: _Paths) -> dict:
    """Train the small detector on the scenes' boxes (shapes as classes, colours as attributes), best/ by
    validation AP, and score it on the held-out scenes with `xmodal detector evaluate`."""
    steps = cfg.detector_steps
    stages.xmodal(
        "detector-train",
        ["detector", "train", "--images", str(data.images_dir), "--annotations", str(data.detection["train"]),
         "--valid", str(data.detection["valid"]), "--out", str(paths.detector), "--preset", DETECTOR_PRESET,
         "--seed", str(cfg.seed), "--max-steps", str(steps), "--lr", str(cfg.detector_lr),
         "--eval-every", str(max(steps // 2, 1)), f"train.lr_steps=[{steps * 4 // 5},{steps * 17 // 18}]",
         f"train.log_every={max(steps // 30, 1)}"],
    )  # fmt: skip
    stages.xmodal(
        "detector-evaluate",
        ["detector", "evaluate", "--weights", str(paths.detector / "best"), "--images", str(data.images_dir),
         "--annotations", str(data.detection["test"]), "--out", str(paths.detector_metrics),
         "--device", "cpu"],
    )  # fmt: skip
    return json.loads(paths.detector_metrics.read_text())


def _extract(stages: _Stages, cfg: DemoConfig, data: SyntheticDataset, paths: _Paths) -> None:
    # `xmodal ask` and training read the settings back from the store's provenance. The trained detector
    # keeps its regressed boxes (the threshold rule); a given checkpoint runs the R101 at toy scale for a
    # CPU budget: small input, few proposals, a small RoI pool.
    if cfg.weights:
        detector = ["--weights", cfg.weights, "--min-size", str(cfg.image_size), "--max-size",
                    str(cfg.image_size), "--set", f"post_nms_topk={cfg.proposals}",
                    "--set", f"pooler_resolution={cfg.pooler_resolution}"]  # fmt: skip
    else:
        detector = ["--weights", _detector_weights(cfg, paths), "--selection", "threshold"]
    stages.xmodal(
        "extract",
        ["extract", str(data.images_dir), "--out", str(paths.features), *detector,
         "--min-boxes", str(cfg.boxes), "--max-boxes", str(cfg.boxes),
         "--batch-size", str(cfg.extract_batch_size), "--workers", "1", "--no-progress"],
    )  # fmt: skip


def _train(stages: _Stages, cfg: DemoConfig, data: SyntheticDataset, paths: _Paths) -> None:
    # One intra-op thread: the tiny model's matrices are too small to split, and on a busy 2-core machine
    # the default thread pool oversubscribes the cores (measured 6 vs 100-300 samples/s in pre-training).
    # DataLoader worker processes cost more than they give for a tiny model on 2 cores.
    common = ["--features", str(paths.features), "--vocab", str(data.vocab), "--seed", str(cfg.seed),
              "--batch-size", str(cfg.batch_size), "train.loader_workers=0",
              f"train.log_every={cfg.log_every}", f"train.eval_every={cfg.eval_every}"]  # fmt: skip
    stages.xmodal(
        "pretrain",
        ["pretrain", "--train", str(data.pretrain["train"]), "--valid", str(data.pretrain["valid"]),
         "--out", str(paths.pretrain), "--preset", "tiny", "--max-steps", str(cfg.pretrain_steps),
         "--lr", str(cfg.pretrain_lr), *common, *cfg.overrides],
        threads=1,
    )  # fmt: skip
    stages.xmodal(
        "finetune",
        ["finetune", "vqa", "--train", str(data.vqa["train"]), "--valid", str(data.vqa["valid"]),
         "--init", str(paths.pretrain / "last"), "--out", str(paths.vqa),
         "--max-steps", str(cfg.finetune_steps), "--lr", str(cfg.finetune_lr), *common, *cfg.overrides],
        threads=1,
    )  # fmt: skip
    stages.xmodal(
        "evaluate",
        ["evaluate", "vqa", "--checkpoint", str(paths.vqa / "best"), "--features", str(paths.features),
         "--split", str(data.vqa["test"]), "--out", str(paths.predictions)],
        threads=1,
    )  # fmt: skip


def _evaluate_other_images(stages: _Stages, cfg: DemoConfig, data: SyntheticDataset, paths: _Paths) -> None:
    """The same model on the held-out questions, each with another held-out image's regions: what it
    scores without the right picture."""
    split = data.vqa["test"].with_name("vqa_test_other_images.json")
    split.write_text(json.dumps(with_other_images(json.loads(data.vqa["test"].read_text()), cfg.seed)))
    stages.xmodal(
        "evaluate other images",
        ["evaluate", "vqa", "--checkpoint", str(paths.vqa / "best"), "--features", str(paths.features),
         "--split", str(split), "--out", str(paths.other_image_predictions)],
        threads=1,
    )  # fmt: skip


def _caption(stages: _Stages, cfg: DemoConfig, data: SyntheticDataset, paths: _Paths) -> dict:
    """Train the Up-Down captioner on the scenes' descriptions, caption the test images with `xmodal
    evaluate`, and describe one image with `xmodal ask --caption` (its attention over time drawn): the test
    image `agreeing_example` picks from the evaluated captions, the first one if none agrees."""
    split = str(data.descriptions)
    stages.xmodal(
        "caption-finetune",
        ["finetune", "caption", "--arch", "updown", "--features", str(paths.features),
         "--train", f"{split}:train", "--valid", f"{split}:val", "--out", str(paths.caption),
         "--seed", str(cfg.seed), "--batch-size", str(cfg.batch_size), "--max-steps", str(cfg.caption_steps),
         "--lr", str(cfg.caption_lr), "task.preset=tiny", "task.vocab_min_count=1",
         # wider than `tiny`: with 48 units the 2048-d region features drown the word input of the LSTMs
         "task.model.hidden_size=256", "task.model.embed_size=256", "task.model.attention_size=128",
         "train.loader_workers=0", "train.clip_norm=1.0", f"train.log_every={cfg.log_every}",
         f"train.eval_every={cfg.eval_every}"],
        threads=1,
    )  # fmt: skip
    stages.xmodal(
        "caption-evaluate",
        ["evaluate", "caption", "--checkpoint", str(paths.caption / "best"),
         "--features", str(paths.features), "--split", f"{split}:test", "--out", str(paths.captions)],
        threads=1,
    )  # fmt: skip
    rows = [r for r in json.loads(data.descriptions.read_text())["images"] if r["split"] == "test"]
    shown = agreeing_example(_predicted_captions(paths), _scenes_by_id(data))
    row = next((r for r in rows if r["cocoid"] == shown), rows[0])
    weights = ["--weights", _detector_weights(cfg, paths)]
    stages.xmodal(
        "caption-ask",
        ["ask", str(data.images_dir / row["filename"]), "--caption",
         "--checkpoint", str(paths.caption / "best"), *weights,
         "--explain", str(paths.root / "report" / "caption_attention.png"),
         "--json", str(paths.root / "report" / "caption.json")],
    )  # fmt: skip
    return row


def _predicted_captions(paths: _Paths) -> dict[int, str]:
    return {r["image_id"]: r["caption"] for r in json.loads(paths.captions.read_text())}


def _scenes_by_id(data: SyntheticDataset) -> dict[int, Scene]:
    """The scenes by their id in the Karpathy files (`cocoid`: the scene's index)."""
    return dict(enumerate(load_scenes(data.scenes)))


def caption_summary(data: SyntheticDataset, paths: _Paths, asked_row: dict) -> dict:
    """`xmodal evaluate`'s caption metrics; CIDEr-D of the model's test captions beside that of the most
    frequent training caption given to every test image (both on the same word tokens); how many test
    captions name every shape's colour and kind, for both; the first test caption that does not, with its
    reference."""
    from pipelines.data.captions import load_caption_examples
    from pipelines.scoring.captions import evaluate_captions

    split = str(data.descriptions)
    train = load_caption_examples(f"{split}:train")
    test = load_caption_examples(f"{split}:test")
    constant = Counter(" ".join(c) for e in train for c in e.label).most_common(1)[0][0]
    refs = {e.image_id: [" ".join(c) for c in e.label] for e in test}
    raw = {e.image_id: e.raw for e in test}
    predicted = _predicted_captions(paths)
    scenes = _scenes_by_id(data)

    def cider(captions: dict) -> float:
        scores = evaluate_captions(refs, captions, pretokenized=True, java=False)
        return round(100 * scores.metrics["CIDEr"], 2)

    asked = json.loads((paths.root / "report" / "caption.json").read_text())
    missed = next((k for k in sorted(predicted) if not names_scene(predicted[k], scenes[k])), None)
    return {
        "metrics": json.loads(paths.captions.with_suffix(".metrics.json").read_text()),
        "cider_d": cider(predicted),
        "baseline_cider_d": cider({k: constant for k in refs}),
        "baseline_caption": constant,
        "test_images": len(test),
        "agreement": caption_agreement(predicted, scenes),
        "baseline_agreement": caption_agreement({k: constant for k in refs}, scenes),
        "ask": {
            "image": asked["image"],
            "caption": asked["caption"],
            "truth": [s["raw"] for s in asked_row["sentences"]],
            "agrees": names_scene(asked["caption"], scenes[asked_row["cocoid"]]),
        },
        "missed": None if missed is None else {
            "image": scenes[missed].img_id, "caption": predicted[missed], "truth": list(raw[missed])
        },
    }  # fmt: skip


def _ask(stages: _Stages, cfg: DemoConfig, data: SyntheticDataset, paths: _Paths, test_rows: list[dict]):
    """`xmodal ask` on the first held-out colour question; it restores the demo's detector settings from
    the extraction recorded in the checkpoint."""
    from pipelines.apps.demo.report import AskResult

    row = next((r for r in test_rows if r["question_type"] == "what color is the"), test_rows[0])
    image = data.images_dir / f"{row['img_id']}.png"
    explain = paths.root / "report" / "ask_attention.png"
    answers_json = paths.root / "report" / "ask.json"
    weights = ["--weights", _detector_weights(cfg, paths)]
    stages.xmodal(
        "ask",
        ["ask", str(image), row["sent"], "--checkpoint", str(paths.vqa / "best"), *weights, "--top-k", "5",
         "--explain", str(explain), "--json", str(answers_json)],
    )  # fmt: skip
    answers = [(a["answer"], a["score"]) for a in json.loads(answers_json.read_text())["answers"]]
    if not answers:
        raise DemoError(f"`xmodal ask` wrote no answers to {answers_json}")
    return AskResult(image=image, question=row["sent"], answers=answers, truth=_answer(row["label"]),
                     explain_png=explain)  # fmt: skip


def run_demo(cfg: DemoConfig, xmodal: Callable[[list[str]], int]) -> dict:
    """Run every stage into `cfg.workdir` through `xmodal(argv) -> exit code` (the CLI's `main`); returns the
    summary also written to summary.json."""
    start = time.perf_counter()
    # absolute paths, so the recorded commands rerun a stage from any folder
    paths = _Paths(Path(cfg.workdir).resolve())
    paths.claim()
    for path in paths.outputs():
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    stages = _Stages(xmodal)
    data = stages.timed(
        "generate",
        lambda: generate(
            paths.data,
            SyntheticConfig(
                num_images=cfg.images, image_size=cfg.image_size, seed=cfg.seed, max_shapes=cfg.max_shapes
            ),
        ),
    )
    detector = None if cfg.weights else _train_detector(stages, cfg, data, paths)
    _extract(stages, cfg, data, paths)
    probe = stages.timed("probe", lambda: linear_probe(data.scenes, paths.features, cfg.seed))
    _train(stages, cfg, data, paths)
    _evaluate_other_images(stages, cfg, data, paths)

    train_rows = json.loads(data.vqa["train"].read_text())
    test_rows = json.loads(data.vqa["test"].read_text())
    summary = {
        **score_predictions(paths.predictions, test_rows),
        **baselines(train_rows, test_rows),
        "evaluate_accuracy": json.loads(paths.predictions.with_suffix(".metrics.json").read_text())[
            "accuracy"
        ],
        "test_questions": len(test_rows),
        "images": f"{data.counts['images_train']}/{data.counts['images_valid']}/{data.counts['images_test']}",
        "seed": cfg.seed,
        "detector_weights": _detector_weights(cfg, paths),
        "detector_trained": detector is not None,
        "detector": detector,
        "probe": probe,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
    }
    summary["margin_points"] = round(summary["accuracy"] - summary["baseline_accuracy"], 2)
    summary["beats_baseline_by_15"] = summary["margin_points"] >= MARGIN_BAR
    # the majority answer ignores the question type; the per-type prior shows what the image itself adds
    summary["margin_over_prior_points"] = round(summary["accuracy"] - summary["prior_baseline_accuracy"], 2)
    # what the model takes from the picture: its own image's regions against another image's
    other = score_predictions(paths.other_image_predictions, test_rows)
    summary["other_images_accuracy"] = other["accuracy"]
    summary["per_type_other_images"] = other["per_type_accuracy"]
    summary["image_gain_points"] = round(summary["accuracy"] - other["accuracy"], 2)
    ask = _ask(stages, cfg, data, paths, test_rows)
    asked_row = _caption(stages, cfg, data, paths)
    summary["caption"] = caption_summary(data, paths, asked_row)
    summary["stage_s"] = stages.seconds
    summary["commands"] = stages.commands
    summary["elapsed_s"] = round(time.perf_counter() - start, 2)
    summary["report"] = str(paths.root / "report.html")
    stages.timed("report", lambda: _report(summary, data, paths, test_rows, ask))
    summary["stage_s"] = stages.seconds
    summary["elapsed_s"] = round(time.perf_counter() - start, 2)
    (paths.root / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _report(summary: dict, data: SyntheticDataset, paths: _Paths, test_rows: list[dict], ask) -> None:
    from extraction.provenance import recorded_names
    from pipelines.apps.demo.report import ReportInputs, write_report
    from storage import FeatureReader

    sample_ids = sorted({r["img_id"] for r in test_rows})[:3]
    reader = FeatureReader(paths.features)
    try:
        detections = [(data.images_dir / f"{i}.png", reader[i]) for i in sample_ids]
        names = recorded_names(reader.meta.get("provenance", {}))  # what the trained detector carries
    finally:
        reader.close()
    write_report(
        ReportInputs(
            out_dir=paths.root,
            summary=summary,
            detections=detections,
            curves={
                "detector": paths.detector / "metrics.jsonl",
                "pre-training": paths.pretrain / "metrics.jsonl",
                "VQA fine-tuning": paths.vqa / "metrics.jsonl",
                "captioning": paths.caption / "metrics.jsonl",
            },
            ask=ask,
            caption_png=paths.root / "report" / "caption_attention.png",
            object_names=names[0],
            attr_names=names[1],
            commands=summary["commands"],
        )
    )
