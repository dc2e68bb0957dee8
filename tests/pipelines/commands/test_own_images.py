"""Your own images in one sitting: nested folders with mixed suffixes, a CSV of questions with plain answers
and a JSON of {image, caption} rows → finetune vqa --images → ask → finetune caption → evaluate caption,
with no id or format conversion written by hand; and a table of malformed files, each one error line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from pipelines.cli import main

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
# (path in the folder, colour); the rows name them as a user would: with folders, bare names, no suffix
PHOTOS = [
    ("2023/beach/IMG_001.jpg", "red"),
    ("2023/beach/IMG_002.JPG", "green"),
    ("2023/city/IMG_003.png", "blue"),
    ("2023/city/IMG_004.jpeg", "red"),
    ("2024/IMG_005.png", "green"),
    ("2024/IMG_006.jpg", "blue"),
    ("2024/trip/IMG_007.webp", "red"),
    ("IMG_008.jpg", "blue"),
]
WORDS = ["what", "colour", "is", "the", "square", "?", "red", "green", "blue", "a", "picture"]
# A small random-weight detector and small inputs: well under a second an image on 2 cores; eight
# photos cover every suffix and folder depth, and the tiny presets keep training and decoding to seconds.
EXTRACT = {
    "min_boxes": 4,
    "max_boxes": 4,
    "batch_size": 4,
    "workers": 1,
    "progress": False,
    "include_dashboard": False,
    "overrides": {
        "min_size": 64,
        "max_size": 96,
        "post_nms_topk": 12,
        "pooler_resolution": 1,
        "blocks_per_stage": [1, 1, 1],
    },
}


def reference(path: str, i: int) -> str:
    """How the rows name a photo: the path, the bare name, or the name without its suffix."""
    return [path, Path(path).name, path.rsplit(".", 1)[0]][i % 3]


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=256 << 20)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def sitting(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("own")
    photos = root / "photos"
    rng = np.random.default_rng(0)
    for path, colour in PHOTOS:
        pixels = rng.integers(0, 60, size=(72, 96, 3), dtype=np.uint8)
        pixels[16:56, 24:72] = COLOURS[colour]
        (photos / path).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(
            photos / path, format=Image.registered_extensions()[Path(path).suffix.lower()]
        )
    questions = root / "questions.csv"
    lines = ["image,question,answer"]
    lines += [f"{reference(p, i)},what colour is the square?,{c}" for i, (p, c) in enumerate(PHOTOS)]
    questions.write_text("\n".join(lines) + "\n")
    captions = root / "captions.json"
    captions.write_text(
        json.dumps(
            [{"image": reference(p, i + 1), "caption": f"a {c} square"} for i, (p, c) in enumerate(PHOTOS)]
        )
    )
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    config = root / "extract.yaml"
    config.write_text(yaml.safe_dump(EXTRACT))
    return {
        "root": root,
        "photos": photos,
        "questions": questions,
        "captions": captions,
        "vocab": vocab,
        "extract": config,
        "cache": root / "cache",
    }


def _vocab(root: Path) -> Path:
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return vocab


def _images_argv(s: dict[str, Path]) -> list[str]:
    return ["--images", str(s["photos"]), "--extract-config", str(s["extract"]), "--cache", str(s["cache"])]


@pytest.fixture(scope="module")
def vqa_run(sitting, ray_session) -> Path:
    """`finetune vqa --images` from the folder and the CSV: the regions extracted into the cache, then
    a tiny model trained (its own step: the tests below time the rest of the sitting)."""
    import torch

    s = sitting
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models gain nothing from threads on a shared 2-core machine
    try:
        out = s["root"] / "runs" / "vqa"
        argv = ["finetune", "vqa", *_images_argv(s), "--train", str(s["questions"]), "--valid"]
        argv += [str(s["questions"]), "--out", str(out), "--preset", "tiny", "--vocab", str(s["vocab"])]
        argv += ["--max-steps", "3", "--batch-size", "4", "train.loader_workers=0"]
        assert main(argv) == 0
    finally:
        torch.set_num_threads(before)
    return out


def _cache_store(s: dict[str, Path]) -> Path:
    stores = list((s["cache"] / "stores").glob("*.lmdb"))
    assert len(stores) == 1
    return stores[0]


@pytest.mark.slow
def test_a_folder_and_a_csv_make_a_vqa_model_that_answers(sitting, vqa_run, capsys, one_thread):
    s = sitting
    from storage import FeatureReader

    reader = FeatureReader(_cache_store(s))
    assert sorted(reader.keys()) == sorted(p for p, _ in PHOTOS)  # the folder's paths are the ids
    reader.close()
    assert (vqa_run / "last").is_dir()

    capsys.readouterr()
    photo = s["photos"] / PHOTOS[0][0]
    assert main(["ask", str(photo), "what colour is the square?", "--checkpoint", str(vqa_run / "last"),
                 "--json", "-", "--min-size", "64", "--max-size", "96"]) == 0  # fmt: skip
    answer = json.loads(capsys.readouterr().out)
    assert answer["question"] == "what colour is the square?"
    assert answer["answers"][0]["answer"] in COLOURS


@pytest.mark.slow
def test_the_cached_regions_make_a_captioner_scored_on_the_caption_rows(sitting, vqa_run, capsys, one_thread):
    s = sitting
    images = _images_argv(s)
    summary = Path(str(_cache_store(s)).replace(".lmdb", ".summary.json"))
    before = summary.stat().st_mtime_ns
    caption = s["root"] / "runs" / "caption"
    argv = ["finetune", "caption", *images, "--train", str(s["captions"]), "--valid", str(s["captions"])]
    argv += ["--out", str(caption), "--preset", "tiny", "--max-steps", "3", "--batch-size", "4"]
    argv += ["task.vocab_min_count=1", "train.loader_workers=0"]
    assert main(argv) == 0
    assert summary.stat().st_mtime_ns == before  # the cache had every image: nothing extracted again

    out = s["root"] / "captions.pred.json"
    argv = ["evaluate", "caption", "--checkpoint", str(caption / "last"), *images]
    argv += ["--split", str(s["captions"]), "--out", str(out)]
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("CIDEr") == 1  # the metrics are printed once (their JSON is in the metrics file)
    metrics = json.loads(Path(str(out).replace(".json", ".metrics.json")).read_text())
    assert f"CIDEr: {metrics['CIDEr']:.2f}" in printed.splitlines()
    joined = [
        json.loads(line) for line in (s["root"] / "captions.pred.joined.jsonl").read_text().splitlines()
    ]
    assert [r["image"] for r in joined] == [reference(p, i + 1) for i, (p, _) in enumerate(PHOTOS)]
    assert all(r["references"] and isinstance(r["prediction"], str) for r in joined)


@pytest.mark.slow
def test_evaluate_images_after_an_own_detector_run_extracts_nothing_again(
    sitting, ray_session, tmp_path, one_thread
):
    """`finetune vqa --images --detector-weights runs/detector/best`, then `evaluate vqa --images` over the
    same folder: evaluation rebuilds the extraction from the run's record (which names the detector's own
    class counts) and must find the store training filled, not extract the folder again."""
    import dataclasses

    from extraction.config import PRESETS, SMALL_PRESET
    from extraction.rcnn import VGFasterRCNN, init_random_weights
    from extraction.weights import save_detector_dir

    s = sitting
    sizes = {k: tuple(v) if isinstance(v, list) else v for k, v in EXTRACT["overrides"].items()}
    config = dataclasses.replace(PRESETS[SMALL_PRESET], num_classes=9, num_attributes=6, **sizes)
    model = VGFasterRCNN(config)
    init_random_weights(model, 3)
    detector = tmp_path / "runs" / "detector" / "best"
    names = [f"shape{i}" for i in range(9)], [f"colour{i}" for i in range(6)]
    save_detector_dir(model.eval(), config, SMALL_PRESET, *names, detector)
    extract = tmp_path / "extract.yaml"  # the job's settings; the detector's come from its directory
    extract.write_text(yaml.safe_dump({k: v for k, v in EXTRACT.items() if k != "overrides"}))
    cache = tmp_path / "cache"
    run = tmp_path / "runs" / "vqa"
    argv = ["finetune", "vqa", "--images", str(s["photos"]), "--extract-config", str(extract)]
    argv += ["--cache", str(cache), "--detector-weights", str(detector), "--train", str(s["questions"])]
    argv += ["--out", str(run), "--preset", "tiny", "--vocab", str(s["vocab"]), "--max-steps", "1"]
    assert main([*argv, "--batch-size", "4", "train.loader_workers=0"]) == 0
    (store,) = (cache / "stores").glob("*.lmdb")
    summary = Path(str(store).replace(".lmdb", ".summary.json"))
    before = summary.stat().st_mtime_ns

    argv = ["evaluate", "vqa", "--checkpoint", str(run / "last"), "--images", str(s["photos"])]
    argv += ["--cache", str(cache), "--split", str(s["questions"]), "--out", str(tmp_path / "p.json")]
    assert main(argv) == 0
    assert list((cache / "stores").glob("*.lmdb")) == [store]
    assert summary.stat().st_mtime_ns == before  # nothing extracted again


def test_rows_naming_pictures_the_folder_lacks_are_listed(sitting, tmp_path, capsys):
    rows = tmp_path / "q.csv"
    rows.write_text(
        "image,question,answer\nIMG_001.jpg,what?,red\nholiday/IMG_999.jpg,what?,red\nnope,x?,red\n"
    )
    argv = ["finetune", "vqa", "--images", str(sitting["photos"]), "--cache", str(tmp_path / "cache")]
    argv += ["--vocab", str(sitting["vocab"])]  # the rows' images are looked up after the vocabulary
    assert main([*argv, "--train", str(rows), "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "2 images named by the rows are not in" in err[0]
    assert "'holiday/IMG_999.jpg'" in err[0] and "'nope'" in err[0]


def test_an_ambiguous_name_is_refused_not_guessed(tmp_path, capsys):
    photos = tmp_path / "photos"
    for sub in ("a", "b"):
        (photos / sub).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(photos / sub / "x.jpg")
    rows = tmp_path / "q.json"
    rows.write_text(json.dumps([{"image": "x.jpg", "question": "what?", "answer": "red"}]))
    argv = ["finetune", "vqa", "--images", str(photos), "--cache", str(tmp_path / "cache")]
    argv += ["--vocab", str(_vocab(tmp_path))]  # the rows' images are looked up after the vocabulary
    assert main([*argv, "--train", str(rows), "--out", str(tmp_path / "run")]) == 1
    assert "several stored images are called 'x' ('a/x.jpg', 'b/x.jpg')" in capsys.readouterr().err


def test_an_ambiguous_name_and_missing_pictures_are_refused_together(tmp_path, capsys):
    """One refusal names every problem of the rows: fixing the ambiguous name and rerunning must not
    reveal missing pictures the first run already knew of."""
    photos = tmp_path / "photos"
    for sub in ("a", "b"):
        (photos / sub).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(photos / sub / "x.jpg")
    rows = tmp_path / "q.csv"
    rows.write_text("image,question,answer\nx.jpg,what?,red\ngone.jpg,what?,red\nlost/y.png,what?,blue\n")
    argv = ["finetune", "vqa", "--images", str(photos), "--cache", str(tmp_path / "cache")]
    argv += ["--vocab", str(_vocab(tmp_path)), "--train", str(rows), "--out", str(tmp_path / "run")]
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert "several stored images are called 'x' ('a/x.jpg', 'b/x.jpg')" in err[0]
    assert "2 images named by the rows are not in" in err[0]
    assert "'gone.jpg'" in err[0] and "'lost/y.png'" in err[0]


def test_a_picture_in_a_suffix_xmodal_does_not_read_is_named_as_such(tmp_path, capsys):
    photos = tmp_path / "photos"
    (photos / "trip").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(photos / "a.jpg")
    (photos / "trip" / "b.heic").write_bytes(b"\0\0\0\x18ftypheic" + bytes(64))  # an iPhone picture
    rows = tmp_path / "q.csv"
    rows.write_text("image,question,answer\na.jpg,what?,red\ntrip/b.heic,what?,blue\n")
    argv = ["finetune", "vqa", "--images", str(photos), "--cache", str(tmp_path / "cache")]
    argv += ["--vocab", str(_vocab(tmp_path))]  # the rows' images are looked up after the vocabulary
    assert main([*argv, "--train", str(rows), "--out", str(tmp_path / "run")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert "suffixes xmodal does not read (.heic)" in err[0] and "'trip/b.heic'" in err[0]
    assert "convert them to .jpg or .png" in err[0]


# (file name, content, what the one error line must name: the line and every problem)
MALFORMED = [
    ("no_columns.csv", "image,text\na.jpg,hello\n", ["line 2", "no 'question'"]),
    ("no_image.csv", "question,answer\nwhat?,red\n", ["line 2", "no 'image'", "image"]),
    ("short_row.csv", "image,question,answer\na.jpg,what?\n", ["line 2", "2 values for the header's 3"]),
    (  # issue 45: the malformed lines and the other rows' problems in one refusal, an empty answer named
        "every_problem.csv",
        "image,question,answer\na.jpg,what?\nb.jpg,,red\nc.jpg,what?,\nIMG_001.jpg,what?,red\n",
        ["line 2: 2 values for the header's 3", "line 3: no 'question'", "line 4: the answer is empty"],
    ),
    ("bad.json", '[{"image": "a.jpg", "question": "q?", "answer": "red"},\n {"image": }]', ["line 2"]),
    ("bad.jsonl", '{"image": "a.jpg", "question": "q?", "answer": "red"}\n{"image": "b.jpg",\n', ["line 2"]),
    (
        "answers_number.json",
        '[{"image": "a.jpg", "question": "q?", "answers": 3}]',
        ["'answers' is a number"],
    ),
    (
        "answers_counts.json",
        '[{"image": "a.jpg", "question": "q?", "answers": {"red": "many"}}]',
        ["counts (whole numbers)"],
    ),
    (
        "all_wrong.json",
        '[\n{"image": "a.jpg", "question": "q?", "answer": "red"},\n'
        '{"image": 1.5, "question": 7, "answer": []}\n]',
        ["row 2 (line 3)", "'image' is a number", "'question' is a number", "'answer' is a list"],
    ),
    ("not_rows.json", '{"version": 2, "info": {}}', ["not a list of rows"]),
    ("scalars.jsonl", '"a.jpg"\n', ["line 1", "text, not an object"]),
    ("binary.json", "\0\1\2binary", ["a binary file"]),
    ("not_stored.csv", "image,question,answer\nelsewhere.jpg,what?,red\n", ["'elsewhere.jpg'", "not in"]),
]


@pytest.mark.parametrize(("name", "content", "named"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_each_malformed_file_is_one_error_line(name, content, named, sitting, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes(content.encode())
    argv = ["finetune", "vqa", "--images", str(sitting["photos"]), "--cache", str(tmp_path / "cache")]
    argv += ["--vocab", str(sitting["vocab"])]  # the rows' images are looked up after the vocabulary
    assert main([*argv, "--train", str(path), "--out", str(tmp_path / "run")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert name in err[0]
    for part in named:
        assert part in err[0], (part, err[0])
    assert re.match(r"xmodal finetune: ", err[0])


def test_ctrl_c_while_extracting_for_a_run_is_one_line(sitting, tmp_path, monkeypatch, capsys):
    import pipelines.jobs.image_cache as image_cache

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(image_cache, "images_store", interrupted)
    argv = ["finetune", "vqa", "--images", str(sitting["photos"]), "--cache", str(tmp_path / "cache")]
    argv += ["--vocab", str(sitting["vocab"])]  # the rows' images are looked up after the vocabulary
    assert main([*argv, "--train", str(sitting["questions"]), "--out", str(tmp_path / "run")]) == 130
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        f"xmodal finetune: stopped while extracting {sitting['photos']}; the images extracted so far are "
        "kept in the cache: rerun the same command to resume"
    ]


@pytest.fixture
def no_extraction(monkeypatch):
    """Fails a test that reaches the extraction: what it checks must be refused before."""
    import pipelines.jobs.image_cache as image_cache

    def extracted(*args, **kwargs):
        raise AssertionError("the images were extracted before the refusal")

    monkeypatch.setattr(image_cache, "images_store", extracted)


@pytest.mark.parametrize("vocab", ["missing/vocab.txt", "no-such-org/no-such-tokenizer"])
def test_the_vocabulary_is_checked_before_any_extraction(vocab, sitting, tmp_path, monkeypatch, no_extraction,
                                                         capsys):  # fmt: skip
    """Issue 45: offline, a tokenizer the run cannot load fails in one line before any photo is extracted."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["finetune", "vqa", "--images", str(sitting["photos"]), "--cache", str(tmp_path / "cache")]
    argv += ["--train", str(sitting["questions"]), "--vocab", vocab, "--out", str(tmp_path / "run")]
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and vocab in err[0], err


def test_a_questions_file_without_answers_names_the_file_and_its_rows(
    sitting, tmp_path, no_extraction, capsys
):
    rows = tmp_path / "questions.csv"
    rows.write_text("image,question\nIMG_001.jpg,what colour is the square?\nIMG_002,what is it?\n")
    argv = ["finetune", "vqa", "--images", str(sitting["photos"]), "--cache", str(tmp_path / "cache")]
    argv += ["--train", str(rows), "--vocab", str(sitting["vocab"]), "--out", str(tmp_path / "run")]
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        f"xmodal finetune: {rows}: 2 of 2 rows have no answer (the file has no 'answer' column: line 2, "
        "line 3); fine-tuning needs labelled rows: give each an 'answer' (or 'answers', 'label')"
    ]


def _readme_own_images() -> list[list[str]]:
    """The `xmodal` commands of the manual's docs/own-images.md block, as written (README.md shows the same
    block; tests/test_readme.py checks that)."""
    import shlex

    page = (Path(__file__).resolve().parents[3] / "docs" / "own-images.md").read_text()
    block = re.search(r"```bash\n(.*?)```", page, flags=re.S).group(1)
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True)[1:] for line in lines if line.startswith("xmodal ")]


@pytest.mark.slow
def test_the_readme_section_runs_as_written_offline(sitting, ray_session, tmp_path, monkeypatch, capsys,
                                                    one_thread):  # fmt: skip
    """The own-images page's commands, in a folder holding photos/, questions.csv and
    captions.json, with no hub (an empty HuggingFace cache, HF_HUB_OFFLINE) and the default batch of 32
    for eight photos; only what keeps it to seconds is added (a small detector, a tiny model, 2 steps)."""
    import shutil

    for name in ("photos", "questions.csv", "captions.json"):
        copy = shutil.copytree if sitting[name.split(".")[0]].is_dir() else shutil.copy
        copy(sitting[name.split(".")[0]], tmp_path / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("XMODAL_CACHE", str(tmp_path / "cache"))
    small = {
        "finetune": ["--preset", "tiny", "--max-steps", "2", "train.loader_workers=0"],
        "ask": ["--min-size", "64", "--max-size", "96"],
    }
    commands = _readme_own_images()
    assert [c[0] for c in commands] == ["vocab", "finetune", "ask", "finetune", "evaluate"]
    for argv in commands:
        extra = small.get(argv[0], [])
        if "--images" in argv:
            extra = [*extra, "--extract-config", str(sitting["extract"])]
        capsys.readouterr()
        assert main([*argv, *extra]) == 0, (argv, capsys.readouterr().err[-2000:])
    assert (tmp_path / "runs" / "vqa" / "last").is_dir() and (tmp_path / "captions.pred.json").is_file()
