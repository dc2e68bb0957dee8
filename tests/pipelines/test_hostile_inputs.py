"""Hostile input through the command line: each is refused with exit 1 and one line naming the key or file,
before any work, never a traceback, a hang or a signal (issue 31's table)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from extraction.config import DetectorConfig, TrainingConfig
from model.architectures import FAMILIES
from pipelines.cli import main
from pipelines.data.masking import MaskingConfig
from pipelines.engine import config_io
from pipelines.engine.trainer import TrainConfig
from pipelines.tasks.finetune import FinetuneRun
from pipelines.tasks.pretrain import PretrainRun
from storage import FeatureWriter, RegionFeatures

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "what", "color", "is", "the", "red", "blue", "?"]
# Each row is refused within ROW_SECONDS of the command starting (issue 31: "within 10 s"). In a fresh
# process the clock starts once the interpreter has loaded torch and the CLI: on a 2-core machine shared
# by a dozen jobs (load average 17-22) those imports alone took 13-27 s of wall time (2-4 s of CPU), which
# says nothing about the input. SUBPROCESS_TIMEOUT only bounds that start-up.
ROW_SECONDS = 10.0
SUBPROCESS_TIMEOUT = 300
# the child: imports first, then `xmodal ARGV` timed; the seconds go to the file named by argv[1]
CHILD = """\
import sys, time
import torch, torchvision
import pipelines.cli as cli
import pipelines.tasks.finetuned, pipelines.tasks.pretrain
cli.build_parser()
start = time.monotonic()
try:
    code = cli.main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as f:
        f.write(str(time.monotonic() - start))
sys.exit(code)
"""


def _store(path: Path, value: float | None = None) -> Path:
    rng = np.random.default_rng(0)
    with FeatureWriter(path, feature_dim=16, max_boxes=4, dtype="float32") as w:
        for i in range(8):
            n = 3
            feats = rng.normal(size=(n, 16)).astype(np.float32) if value is None else np.full((n, 16), value)
            boxes = np.array([[0, 0, 10, 10]] * n, np.float32)
            ones = np.ones(n, np.float32)
            labels = np.zeros(n, np.int64)
            w.put(
                RegionFeatures(
                    f"img{i}", 100, 100, boxes, feats.astype(np.float32), labels, ones, labels, ones
                )
            )
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    _store(root / "f.lmdb")
    (root / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    rows = [
        {"question_id": i, "img_id": f"img{i}", "sent": "what color is the ?", "label": {"red": 1.0}}
        for i in range(8)
    ]
    (root / "train.json").write_text(json.dumps(rows))
    return root


def _finetune(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "finetune", "vqa", "--features", str(data / "f.lmdb"), "--train", str(data / "train.json"),
        "--vocab", str(data / "vocab.txt"), "--out", str(out), "--max-steps", "1",
        "task.preset=tiny", "train.batch_size=2", "train.loader_workers=0", "train.trackers=[]", *extra,
    ]  # fmt: skip


def _timed(run, *args):
    """`run(*args)`, asserting it returned within ROW_SECONDS of wall time."""
    start = time.monotonic()
    result = run(*args)
    elapsed = time.monotonic() - start
    assert elapsed <= ROW_SECONDS, f"took {elapsed:.1f} s (more than {ROW_SECONDS} s)"
    return result


def _refused(argv: list[str], capsys, caplog, needle: str) -> list[str]:
    """`xmodal argv` in this process: exit 1 within ROW_SECONDS, and the error is one line holding
    `needle`."""
    assert _timed(main, argv) == 1
    captured = capsys.readouterr()
    text = captured.err + "\n" + captured.out + "\n" + caplog.text
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if needle in line]
    assert lines, f"no line names {needle!r}:\n{text}"
    return lines


def _refused_subprocess(argv: list[str], needle: str, seconds_allowed: float | None = ROW_SECONDS) -> None:
    """`xmodal argv` in its own process: exit 1 (no signal), no traceback, within `seconds_allowed` of the
    command starting (see CHILD; None: only SUBPROCESS_TIMEOUT)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        seconds = Path(tmp) / "seconds"
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(seconds), *argv],
            capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, env=env, cwd=ROOT,
        )  # fmt: skip
        elapsed = float(seconds.read_text()) if seconds.exists() else None
    assert done.returncode == 1, done.stderr[-2000:]
    assert elapsed is not None, done.stderr[-2000:]
    if seconds_allowed is not None:
        assert elapsed <= seconds_allowed, f"took {elapsed:.1f} s (more than {seconds_allowed} s)"
    assert "Traceback" not in done.stderr
    assert any(needle in line for line in done.stderr.splitlines()), done.stderr[-2000:]


DEEP = "[" * 1000 + "1" + "]" * 1000


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.batch_size=-8", "train.batch_size=-8 is out of range"),
        ("train.batch_size=0", "train.batch_size=0 is out of range"),
        ("train.grad_accum=0", "train.grad_accum=0"),
        ("train.log_every=0", "train.log_every=0"),
        ("task.model.num_attention_heads=0", "num_attention_heads=0"),
        ("train.max_steps=-5", "train.max_steps=-5"),
        ("train.warmup_ratio=2", "train.warmup_ratio=2.0 is out of range: must be [0, 1]"),
        ("train.clip_norm=-1", "train.clip_norm=-1.0"),
        ("train.save_every=0", "train.save_every=0"),
        ("train.lr=.inf", "train.lr=inf must be a finite number"),
        ("train.lr=1e400", "train.lr=inf must be a finite number"),
        ("task.model.vocab_size=1000000000", "vocab_size=1000000000 is out of range"),
        ("task.model.hidden_size=10000000", "hidden_size=10000000 is out of range"),
        (f"train.lr={DEEP}", "nested too deeply"),
        ("train.device=cuda:7", "train.device='cuda:7'"),
    ],
)
def test_settings_out_of_range_are_one_line(override, needle, data, tmp_path, capsys, caplog):
    if override.startswith("train.device"):
        import torch

        if torch.cuda.device_count() > 7:
            pytest.skip("this machine has a cuda:7")
    _refused(_finetune(data, tmp_path / "run", override), capsys, caplog, needle)
    assert not (tmp_path / "run" / "checkpoints").exists()  # refused before any work


def test_pretrain_masking_probability(data, tmp_path, capsys, caplog):
    argv = [
        "pretrain", "--features", str(data / "f.lmdb"), "--train", str(data / "train.json"),
        "--out", str(tmp_path / "run"), "task.masking.mlm_prob=2",
    ]  # fmt: skip
    _refused(argv, capsys, caplog, "task.masking.mlm_prob=2.0 is out of range")


def test_config_file_values_name_the_file_and_line(data, tmp_path, capsys, caplog):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  lr: 1.0e-4\n  batch_size: -8\n")
    _refused(_finetune(data, tmp_path / "run", "--config", str(config)), capsys, caplog, "line 3")
    deep = tmp_path / "deep.yaml"
    deep.write_text("train:\n  lr: " + DEEP + "\n")
    _refused(_finetune(data, tmp_path / "run", "--config", str(deep)), capsys, caplog, "nested")


def test_config_that_is_a_device_or_a_fifo(data, tmp_path):
    _refused_subprocess(_finetune(data, tmp_path / "a", "--config", "/dev/zero"), "not a regular file")
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    _refused_subprocess(_finetune(data, tmp_path / "b", "--config", str(fifo)), "not a regular file")


def test_model_directory_config_of_the_wrong_type(data, tmp_path, capsys, caplog):
    from model import LxmertConfig, LxmertForPreTraining

    init = tmp_path / "init"
    LxmertForPreTraining(LxmertConfig.preset("tiny", vocab_size=len(WORDS))).save_pretrained(init)
    meta = json.loads((init / "config.json").read_text())
    meta["config"]["hidden_size"] = "abc"
    (init / "config.json").write_text(json.dumps(meta))
    argv = _finetune(data, tmp_path / "run", "--init", str(init))
    argv.remove("task.preset=tiny")
    _refused(argv, capsys, caplog, "hidden_size='abc' must be an integer")


def test_huggingface_index_naming_a_fifo(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(
        json.dumps({"model_type": "lxmert", "hidden_size": 64, "num_attention_heads": 2})
    )
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard.safetensors"}}))
    os.mkfifo(src / "shard.safetensors")
    _refused_subprocess(["convert", "lxmert", str(src), str(tmp_path / "out")], "not a regular file")


def test_extract_settings(tmp_path, capsys, caplog):
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "imgs" / "a.jpg")
    base = ["extract", str(tmp_path / "imgs"), "--out", str(tmp_path / "x.lmdb"), "--preset", "c4-small"]
    bomb = "x={a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1], b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]}"
    _refused([*base, "--set", bomb], capsys, caplog, "aliases")
    _refused([*base, "--set", "pooler_resolution=-1"], capsys, caplog, "pooler_resolution=-1 is out of range")
    assert not (tmp_path / "x.lmdb").exists()


def test_json_nested_ten_thousand_levels(data, tmp_path, capsys, caplog):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 10000 + "]" * 10000)
    _refused(_finetune(data, tmp_path / "run", "--train", str(deep)), capsys, caplog, "nested too deeply")
    answers = _finetune(data, tmp_path / "run2", "--answers", str(deep))
    _refused(answers, capsys, caplog, "nested too deeply")
    _refused(
        ["score", "vqa", str(deep), "--gold", str(data / "train.json")], capsys, caplog, "nested too deeply"
    )


@pytest.mark.parametrize(
    ("sentences", "needle"),
    [(3, "sentences is int"), (None, "sentences is NoneType"), ([{"tokens": [1, 2]}], "tokens must be")],
)
def test_caption_files_of_the_wrong_shape(sentences, needle, tmp_path):
    from pipelines.data.captions import CaptionDataError, read_karpathy_split

    path = tmp_path / "dataset_coco.json"
    row = {"filename": "a.jpg", "split": "train", "cocoid": 1, "sentences": sentences}
    path.write_text(json.dumps({"images": [row]}))
    start = time.monotonic()
    with pytest.raises(CaptionDataError, match=needle) as info:
        read_karpathy_split(path)
    assert time.monotonic() - start <= ROW_SECONDS
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"), [("num_boxes", "1000000000000"), ("num_boxes", "2000000000"), ("img_h", str(10**30))]
)
@pytest.mark.parametrize("skip_bad", [False, True])
def test_tsv_rows_with_impossible_sizes(field, value, skip_bad, tmp_path, capsys, caplog):
    import base64

    def b64(values: list[float]) -> str:
        return base64.b64encode(np.array(values, np.float32).tobytes()).decode()

    good = {"img_id": "good", "img_w": "10", "img_h": "10", "num_boxes": "1", "boxes": b64([0, 0, 5, 5])}
    good["features"] = b64([0.5] * 16)
    bad = {**good, "img_id": "bad", field: value}
    tsv = tmp_path / "in.tsv"
    tsv.write_text("".join("\t".join(row.values()) + "\n" for row in (bad, good)))
    argv = ["features", "import", str(tsv), str(tmp_path / "f.lmdb"), *(["--skip-bad"] if skip_bad else [])]
    code = _timed(main, argv)
    captured = capsys.readouterr()
    text = captured.err + captured.out + caplog.text
    assert "Traceback" not in text
    assert f"field {field} is {value}" in text
    assert code == (0 if skip_bad else 1)


def test_non_finite_loss_is_one_line(data, tmp_path, capsys, caplog):
    huge = _store(tmp_path / "huge.lmdb", value=3e38)  # finite float32, but overflows in the first layer
    argv = [str(huge) if a == str(data / "f.lmdb") else a for a in _finetune(data, tmp_path / "run")]
    _refused(argv, capsys, caplog, "loss is nan at step 1")


def test_store_metadata_that_lies(data, tmp_path, capsys, caplog):
    import shutil

    import lmdb

    lie = tmp_path / "lie.lmdb"
    shutil.copytree(data / "f.lmdb", lie)
    env = lmdb.open(str(lie), max_dbs=4, subdir=True)
    db = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(b"meta", db=db))
        txn.put(b"meta", json.dumps({**meta, "feature_dim": "abc"}).encode(), db=db)
    env.close()
    argv = [str(lie) if a == str(data / "f.lmdb") else a for a in _finetune(data, tmp_path / "run")]
    _refused(argv, capsys, caplog, "feature_dim='abc'")
    _refused(["features", "info", str(lie)], capsys, caplog, "feature_dim='abc'")


def _lie(src: Path, dst: Path, **change) -> Path:
    """A copy of store `src` whose metadata record says `change` (its records are untouched)."""
    import shutil

    import lmdb

    shutil.copytree(src, dst)
    env = lmdb.open(str(dst), max_dbs=4, subdir=True)
    db = env.open_db(b"meta")
    with env.begin(write=True) as txn:
        meta = json.loads(txn.get(b"meta", db=db))
        txn.put(b"meta", json.dumps({**meta, **change}).encode(), db=db)
    env.close()
    return dst


LIES = {
    "feature_dim": ({"feature_dim": 65536}, "holds 16-d features"),
    "dtype": ({"dtype": "float16"}, "holds float32 features"),
    "max_boxes": ({"max_boxes": 2}, "holds 3 boxes"),
    "count": ({"count": 10**12}, "it holds 8 records"),
}


@pytest.fixture(scope="module")
def lies(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("lies")
    return {
        name: _lie(data / "f.lmdb", root / f"{name}.lmdb", **change) for name, (change, _) in LIES.items()
    }


@pytest.fixture(scope="module")
def checkpoint(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("tuned") / "run"
    assert main(_finetune(data, out)) == 0
    return out / "last"


def _store_commands(data: Path, store: Path, tmp: Path, checkpoint) -> dict[str, list[str]]:
    from PIL import Image

    Image.new("RGB", (100, 100)).save(tmp / "img0.jpg")
    (tmp / "imgs").mkdir()
    Image.new("RGB", (32, 32)).save(tmp / "imgs" / "img0.jpg")
    finetune = _finetune(data, tmp / "run")
    captions = [{"img_id": f"img{i}", "caption": "a red thing"} for i in range(8)]
    (tmp / "captions.json").write_text(json.dumps(captions))
    import base64

    values = [np.array([0, 0, 5, 5], np.float32), np.full(16, 0.5, np.float32)]
    boxes, feats = (base64.b64encode(v.tobytes()).decode() for v in values)
    (tmp / "in.tsv").write_text("\t".join(["new", "10", "10", "1", boxes, feats]) + "\n")
    sentences = [{"img_id": f"img{i}", "sentf": {"mscoco": ["what color is the ?"]}} for i in range(8)]
    (tmp / "pretrain.json").write_text(json.dumps(sentences))
    return {
        "finetune": [str(store) if a == str(data / "f.lmdb") else a for a in finetune],
        "pretrain": [
            "pretrain", "--features", str(store), "--train", str(tmp / "pretrain.json"),
            "--vocab", str(data / "vocab.txt"), "--out", str(tmp / "pre"), "--max-steps", "1",
            "task.preset=tiny", "train.batch_size=2", "train.loader_workers=0", "train.trackers=[]",
        ],
        "caption": [
            "finetune", "caption", "--features", str(store), "--train", str(tmp / "captions.json"),
            "--vocab", str(data / "vocab.txt"), "--out", str(tmp / "cap"), "--max-steps", "1",
            "train.batch_size=2", "train.loader_workers=0", "train.trackers=[]",
        ],
        "evaluate": [
            "evaluate", "vqa", "--checkpoint", str(checkpoint),
            "--features", str(store), "--split", str(data / "train.json"), "--out", str(tmp / "pred.json"),
        ],
        "info": ["features", "info", str(store)],
        "ls": ["features", "ls", str(store)],
        "verify": ["features", "verify", str(store)],
        "show": ["features", "show", str(store), "img0", "--image", str(tmp / "img0.jpg"),
                 "--out", str(tmp / "shown.png")],
        "export": ["features", "export", str(store), str(tmp / "out.tsv")],
        "extract": ["extract", str(tmp / "imgs"), "--out", str(store), "--preset", "c4-small"],
        "merge": ["features", "merge", str(store), str(tmp / "merged.lmdb")],
        "import": ["features", "import", str(tmp / "in.tsv"), str(store)],
    }  # fmt: skip


STORE_COMMANDS = [
    "finetune",
    "pretrain",
    "caption",
    "evaluate",
    "info",
    "ls",
    "verify",
    "show",
    "export",
    "extract",
    "merge",
    "import",
]
# `ask` and `serve` read no store: they run the detector on the image, with the extraction settings the
# checkpoint recorded when it was fine-tuned, so a store damaged since cannot reach them.


@pytest.mark.parametrize("command", STORE_COMMANDS)
@pytest.mark.parametrize("lie", sorted(LIES))
def test_store_whose_metadata_lies_about_its_records(
    command, lie, data, lies, request, tmp_path, capsys, caplog
):
    """Every command that reads a store stops on the same line (storage.contents), before any work."""
    store = lies[lie]
    if command == "evaluate" and lie != "count":
        pytest.skip("one lie suffices for evaluate, which needs a fine-tuned checkpoint first")
    model = request.getfixturevalue("checkpoint") if command == "evaluate" else None
    argv = _store_commands(data, store, tmp_path, model)[command]
    claim = LIES[lie][0]
    key, value = next(iter(claim.items()))
    lines = _refused(
        argv, capsys, caplog, f"store {store} is damaged: its metadata record says {key}={value} but"
    )
    assert LIES[lie][1] in lines[0] and f"xmodal features verify {store}" in lines[0]


TOKEN_LIES = {
    "count": ({"count": 10**12}, "it holds 4 records"),
    "grid": ({"grid": 8}, "holds a 4 x 4 grid"),
}


@pytest.fixture(scope="module")
def token_stores(tmp_path_factory):
    """A tiny dVAE (4 x 4 grids of 7 codes), a token store it could have made, a captions file, and copies
    of the store whose metadata lies."""
    import torch

    from model.dalle import DiscreteVAE, DVAEConfig
    from storage.token_store import TokenWriter

    root = tmp_path_factory.mktemp("tokens")
    torch.manual_seed(0)
    cfg = DVAEConfig(image_size=16, downsample=4, hidden_size=8, codebook_size=7, blocks_per_group=1)
    DiscreteVAE(cfg).save_pretrained(root / "tok")
    rng = np.random.default_rng(0)
    with TokenWriter(root / "t.lmdb", grid=4, codebook_size=7) as writer:
        for i in range(4):
            writer.put(f"img{i}", rng.integers(0, 7, (4, 4)))
    images = [
        {"filename": f"img{i}.png", "split": "train", "sentences": [{"raw": "a red square"}]}
        for i in range(4)
    ]
    (root / "caps.json").write_text(json.dumps({"images": images}))
    (root / "imgs").mkdir()
    from PIL import Image

    Image.new("RGB", (16, 16)).save(root / "imgs" / "img9.png")
    lies = {
        name: _lie(root / "t.lmdb", root / f"{name}.lmdb", **change)
        for name, (change, _) in TOKEN_LIES.items()
    }
    return root, lies


@pytest.mark.parametrize("command", ["train", "tokenize"])
@pytest.mark.parametrize("lie", sorted(TOKEN_LIES))
def test_token_store_whose_metadata_lies(command, lie, token_stores, tmp_path, capsys, caplog):
    """`generate train` reading an image-token store, and `generate tokenize` resuming one, stop on the
    line every region-store reader gives (storage.contents), with the token store's remedy."""
    root, lies = token_stores
    store = lies[lie]
    argv = {
        "train": [
            "generate", "train", "--features", str(store), "--captions", str(root / "caps.json"),
            "--tokenizer", str(root / "tok"), "--out", str(tmp_path / "run"), "--max-steps", "1",
            "train.loader_workers=0", "train.trackers=[]",
        ],
        "tokenize": [
            "generate", "tokenize", "--images", str(root / "imgs"), "--tokenizer", str(root / "tok"),
            "--out", str(store),
        ],
    }[command]  # fmt: skip
    key, value = next(iter(TOKEN_LIES[lie][0].items()))
    lines = _refused(
        argv, capsys, caplog, f"store {store} is damaged: its metadata record says {key}={value} but"
    )
    assert TOKEN_LIES[lie][1] in lines[0] and "xmodal generate tokenize" in lines[0]
    assert not (tmp_path / "run").exists()


def test_lying_store_with_loader_workers_is_one_line_not_a_signal(data, lies, tmp_path):
    """The batched read path (FeatureReader.read_batch in DataLoader workers) never meets a lying store."""
    store = lies["feature_dim"]
    argv = [str(store) if a == str(data / "f.lmdb") else a for a in _finetune(data, tmp_path / "run")]
    argv = [a for a in argv if a != "train.loader_workers=0"] + ["train.loader_workers=2"]
    _refused_subprocess(argv, "its metadata record says feature_dim=65536 but record 'img0' holds 16-d")


# ---- every field of the training, task, model and detector configs, with values of the wrong kind
WRONG = ["abc", -1, 0, -1e30, 1e30, float("nan"), True, [1], {"a": 1}, None]
CLASSES = [TrainConfig, MaskingConfig, DetectorConfig, TrainingConfig] + [
    f.config_class for f in FAMILIES.values()
]


@pytest.mark.parametrize("cls", sorted(set(CLASSES), key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_every_field_refuses_or_accepts_cleanly(cls):
    """Each wrong value is refused with one line naming the key, or accepted into a config that passes
    the same check; never another exception."""
    for f in dataclasses.fields(cls):
        for value in WRONG:
            try:
                config_io.check_settings((cls,), {f.name: value}, "test")
                if hasattr(cls, "from_dict"):
                    cls.from_dict({f.name: value})
                elif dataclasses.is_dataclass(cls):
                    base = cls()
                    changed = dataclasses.replace(
                        base,
                        **{f.name: config_io._coerce(value, type(getattr(base, f.name)), "test", f.name)},
                    )
                    config_io.check(changed)
            except ValueError as exc:
                assert "\n" not in str(exc)
                # the field, or for a check across fields (pad and bos ids equal) the class, is named
                assert f.name in str(exc) or cls.__name__ in str(exc), str(exc)


def test_run_configs_refuse_wrong_values_from_overrides():
    for run in (FinetuneRun, PretrainRun):
        for f in dataclasses.fields(TrainConfig):
            for value in ("abc", "-1", "1e400", "[[1]]", "{a: 1}"):
                try:
                    config_io.load(run, None, [f"train.{f.name}={value}"])
                except ValueError as exc:
                    assert "\n" not in str(exc) and f"train.{f.name}" in str(exc), str(exc)


@pytest.mark.slow
def test_non_finite_loss_on_ray_train_workers_is_the_same_line(data, tmp_path):
    """Every worker stops at the same micro-batch; Ray neither retries bad input nor logs its traceback."""
    huge = _store(tmp_path / "huge.lmdb", value=3e38)
    argv = [str(huge) if a == str(data / "f.lmdb") else a for a in _finetune(data, tmp_path / "run")]
    # not a row of the table: starting Ray and two train workers takes a minute or two on a busy machine
    _refused_subprocess([*argv, "--workers", "2"], "xmodal finetune: loss is nan at step 1", None)


@pytest.fixture(scope="module")
def swapped(data, tmp_path_factory):
    """A copy of the store whose value under img3 is img4's record (a pointer gone wrong): lmdb, the
    metadata and every checksum are sound; only the id inside the value tells."""
    import shutil

    from storage import FeatureReader

    dst = tmp_path_factory.mktemp("swapped") / "f.lmdb"
    shutil.copytree(data / "f.lmdb", dst)
    size = len(FeatureReader(dst).get_encoded("img4"))
    raw = bytearray((dst / "data.mdb").read_bytes())
    # a small value sits in its leaf right after its key; the value starts with the record magic
    at3, at4 = (raw.index(f"img{i}XMRF".encode()) + 4 for i in (3, 4))
    raw[at3 : at3 + size] = raw[at4 : at4 + size]
    (dst / "data.mdb").write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("command", ["finetune", "pretrain", "evaluate", "export"])
def test_a_value_holding_another_record_is_refused(command, data, swapped, request, tmp_path, capsys, caplog):
    """Training, evaluation and export name the id asked for and the id found, and stop with exit 1,
    instead of training on (or exporting) the wrong image's regions."""
    model = request.getfixturevalue("checkpoint") if command == "evaluate" else None
    argv = _store_commands(data, swapped, tmp_path, model)[command]
    assert main(argv) == 1  # not timed: the refusal comes at the first read of img3, after set-up
    captured = capsys.readouterr()
    text = captured.err + "\n" + captured.out + "\n" + caplog.text
    assert "Traceback" not in text
    wrong = "the value stored under 'img3' is the record of 'img4'"
    lines = [line for line in text.splitlines() if wrong in line]
    assert lines and f"store {swapped} is damaged" in lines[0], text
    assert not list(tmp_path.glob("out.tsv*"))
