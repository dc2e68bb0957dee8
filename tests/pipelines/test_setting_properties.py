"""Properties of every setting (issue 31): any value of the wrong type, sign or range for any field of the
training, task, model and detector configs, and any `KEY=VALUE` text, is refused with one line before any
work, or accepted into a config whose every field is inside its declared range. Never another exception.

The fields are enumerated from the dataclasses, so a new field is drawn from without editing this file. The
commands' own resolution functions run in this process (fast); a few CLI runs (slow) check the one-line
contract end to end."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from extraction.config import DetectorConfig, TrainingConfig
from extraction.selection import SelectionConfig
from model.architectures import FAMILIES
from model.dalle import DalleConfig, DVAEConfig
from model.ranges import check_fields
from pipelines.cli import build_parser
from pipelines.commands import detector as detector_command
from pipelines.commands import extract as extract_command
from pipelines.commands import finetune as finetune_command
from pipelines.commands import generate as generate_command
from pipelines.commands import pretrain as pretrain_command
from pipelines.data.masking import MaskingConfig
from pipelines.engine import config_io
from pipelines.engine.trainer import TrainConfig
from pipelines.jobs.extract.config import ExtractConfig
from pipelines.tasks.detection import DetectorTaskConfig
from pipelines.tasks.finetune import FinetuneConfig
from pipelines.tasks.generation import TokenizerRun, TokenizerTaskConfig
from pipelines.tasks.model_setup import check_model_overrides
from pipelines.tasks.pretrain import PretrainConfig
from pipelines.tasks.text_to_image import TextToImageRun, TextToImageTaskConfig

ROOT = Path(__file__).resolve().parents[2]
# derandomized: CI draws the same examples every run; no per-example deadline (a busy 2-core machine
# stalls now and then), the whole test is bounded by max_examples
PROPERTY = settings(
    max_examples=200,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FAMILY_CLASSES = sorted({f.config_class for f in FAMILIES.values()}, key=lambda c: c.__name__)

# command -> the config classes reached through its KEY=VALUE overrides, by key prefix
COMMANDS: dict[str, list[tuple[str, type]]] = {
    "finetune": [("train.", TrainConfig), ("task.", FinetuneConfig)]
    + [("task.model.", cls) for cls in FAMILY_CLASSES],
    "pretrain": [("train.", TrainConfig), ("task.", PretrainConfig), ("task.masking.", MaskingConfig)]
    + [("task.model.", cls) for cls in FAMILY_CLASSES],
    "extract": [("", ExtractConfig), ("overrides.", DetectorConfig), ("overrides.", SelectionConfig)],
    # DALL-E's two stages (`train.` is the same TrainConfig as above)
    "generate-tokenizer": [("task.", TokenizerTaskConfig), ("task.dvae.", DVAEConfig)],
    "generate-train": [("task.", TextToImageTaskConfig), ("task.dalle.", DalleConfig)],
    "detector": [
        ("train.", TrainConfig),
        ("task.", DetectorTaskConfig),
        ("task.detector.", DetectorConfig),
        ("task.training.", TrainingConfig),
    ],
}
KEYS = [
    (command, prefix, cls, f.name)
    for command, targets in COMMANDS.items()
    for prefix, cls in targets
    for f in dataclasses.fields(cls)
    if f.init
]
MODEL_FIELDS = [
    (cls, f.name) for cls in [*FAMILY_CLASSES, DVAEConfig, DalleConfig] for f in dataclasses.fields(cls)
]

SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),  # NaN and the infinities too
    st.booleans(),
    st.none(),
    st.text(max_size=12),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(st.text(max_size=6), SCALARS, max_size=2),
    st.sampled_from(["cuda:99", "mps", "cpu", "1e400", "-0", "0x10", "1_000", "[[[[1]]]]"]),
)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def _edges(cls: type, name: str) -> list[float]:
    """Values on and just beside each bound of the field's declared range."""
    spec = getattr(cls, "RANGES", {}).get(name, "")
    out: list[float] = []
    for text in NUMBER.findall(spec):
        x = float(text)
        out += [x, -x, x - 1, x + 1, math.nextafter(x, -math.inf), math.nextafter(x, math.inf)]
        if x.is_integer():
            out += [int(x), int(x) - 1, int(x) + 1]
    return out


WRONG_SIGN = st.one_of(
    st.integers(max_value=-1), st.floats(max_value=-1e-300, allow_infinity=True), st.just(-0.0)
)


def _value_for(cls: type, name: str) -> st.SearchStrategy:
    """Of the wrong type (or any type), of the wrong sign, or on and beside the declared range's bounds."""
    edges = _edges(cls, name)
    return st.one_of(VALUES, WRONG_SIGN, *([st.sampled_from(edges)] if edges else []))


def _yaml(value: typing.Any) -> str:
    """`value` as the text after `=` in KEY=VALUE (YAML flow style, on one line)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _argv(command: str, out: Path, overrides: list[str]) -> list[str]:
    data = ["--features", "f.lmdb", "--train", "train.json"]
    head = {
        "finetune": ["finetune", "vqa", *data],
        "pretrain": ["pretrain", *data],
        "detector": ["detector", "train", "--images", "imgs", "--annotations", "boxes.json"],
        "extract": ["extract", "imgs"],
        "generate-tokenizer": ["generate", "train-tokenizer", "--images", "imgs"],
        "generate-train": ["generate", "train", "--features", "t.lmdb", "--captions", "c.json"],
    }[command]
    return [*head, "--out", str(out), *overrides]


RESOLVE = {
    "finetune": finetune_command.resolve_config,
    "pretrain": pretrain_command.resolve_config,
    "detector": detector_command.resolve_train_config,
    "extract": extract_command.resolve_extract_config,
    "generate-tokenizer": generate_command.resolve_tokenizer_config,
    "generate-train": generate_command.resolve_train_config,
}


@functools.cache
def _parser():
    return build_parser()


def _resolve(command: str, overrides: list[str], workdir: Path):
    """The command's own resolution, from its parsed arguments; SystemExit(1) is argparse refusing."""
    args = _parser().parse_args(_argv(command, workdir / "run", overrides))
    return RESOLVE[command](args)


def _assert_one_line(exc: BaseException, *names: str) -> None:
    event("refused")
    text = str(exc)
    assert text and "\n" not in text and "Traceback" not in text, text
    if names:
        assert any(n in text for n in names), text


def _assert_valid(cfg: typing.Any) -> None:
    """Every field, nested ones too, inside its type and range; free-form model settings as well."""
    event("accepted")
    config_io.check(cfg)
    task = getattr(cfg, "task", None)
    if isinstance(getattr(task, "model", None), dict):
        check_model_overrides(task.model)
    for name, cls in (("dvae", DVAEConfig), ("dalle", DalleConfig)):
        if isinstance(getattr(task, name, None), dict):
            config_io.check_settings((cls,), getattr(task, name), f"task.{name}")
    if isinstance(cfg, ExtractConfig):
        config_io.check_settings((DetectorConfig, SelectionConfig), cfg.overrides, "overrides")
    if isinstance(task, DetectorTaskConfig):
        config_io.check_settings((DetectorConfig,), task.detector, "task.detector")
        config_io.check_settings((TrainingConfig,), task.training, "task.training")


def _no_work_done(workdir: Path) -> None:
    assert list(workdir.iterdir()) == [], "resolution wrote files"
    ray = sys.modules.get("ray")
    assert ray is None or not ray.is_initialized(), "resolution started Ray"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("settings")


def _check_setting(command: str, prefix: str, cls: type, name: str, value: typing.Any, workdir: Path) -> None:
    override = f"{prefix}{name}={_yaml(value)}"
    try:
        cfg = _resolve(command, [override], workdir)
    except ValueError as exc:
        _assert_one_line(exc, name, cls.__name__)
    else:
        _assert_valid(cfg)
    _no_work_done(workdir)


# every key in every run: the keys in STRIPES interleaved stripes, each example drawing a value for each
# key of its stripe (the family fields once, through finetune: pretrain's `task.model` is the same check)
STRIPES = 8
SWEEP = [k for k in KEYS if not (k[0] == "pretrain" and k[1] == "task.model.")]


@pytest.mark.parametrize("stripe", range(STRIPES))
@settings(PROPERTY, max_examples=2)
@given(data=st.data())
def test_every_setting_refuses_wrong_values_on_one_line_or_is_valid(stripe, data, workdir):
    for command, prefix, cls, name in SWEEP[stripe::STRIPES]:
        value = data.draw(_value_for(cls, name), label=f"{prefix}{name}")
        _check_setting(command, prefix, cls, name, value, workdir)


@settings(PROPERTY, max_examples=150)
@given(data=st.data())
def test_any_value_for_any_setting_is_refused_on_one_line_or_valid(data, workdir):
    """Single keys at random, so that a failure shrinks to one key and one value."""
    command, prefix, cls, name = data.draw(st.sampled_from(KEYS), label="key")
    value = data.draw(_value_for(cls, name), label="value")
    _check_setting(command, prefix, cls, name, value, workdir)


@PROPERTY
@given(data=st.data())
def test_any_value_for_any_model_field_is_refused_on_one_line_or_valid(data):
    """Model configs as a preset, a checkpoint's config.json or `finetune --init` build them."""
    cls, name = data.draw(st.sampled_from(MODEL_FIELDS), label="field")
    value = data.draw(_value_for(cls, name), label="value")
    preset = sorted(cls.PRESETS)[0]
    try:
        cfg = cls.preset(preset, **{name: value})
    except ValueError as exc:  # a check across fields names the family's preset ("pad/bos/eos ids ...")
        _assert_one_line(exc, name, cls.__name__, f"{cls.FAMILY} preset")
    else:
        event("accepted")
        check_fields(cfg, "test")


# KEY=VALUE text as a user might mistype it: no `=`, empty or doubled dots, unknown keys, YAML that is
# unterminated, tagged, aliased or nested deeply, control characters, anything at all
DOTTED = sorted({f"{prefix}{name}" for _, prefix, _, name in KEYS})
MANGLED_KEYS = st.one_of(
    st.sampled_from(DOTTED),
    st.sampled_from(DOTTED).map(lambda k: k.replace(".", "..", 1)),
    st.sampled_from(DOTTED).map(lambda k: f".{k}"),
    st.sampled_from(DOTTED).map(lambda k: f"{k}."),
    st.sampled_from(DOTTED).map(lambda k: f"{k}.x"),
    st.sampled_from(DOTTED).map(lambda k: k.rpartition(".")[0] or k),
    st.sampled_from(["", "train", "task", "x", "train.", "_", "train.lr.lr.lr"]),
    st.text(max_size=12),
)
BAD_YAML = st.sampled_from(
    [
        "", "[", "{", "]]", "{a: 1", "'", '"', "- 1", "1: 2: 3", "\t", "%YAML 1.1", "---", "...",
        "!!python/object/apply:os.system ['true']", "!!binary aGk=", "&a [*a]", "*a", "[&a 1, *a]",
        "[" * 200 + "]" * 200, "{a: " * 100 + "1" + "}" * 100, "=", "==1", "\x00", "\x1b[31m", "1e999",
    ]
)  # fmt: skip
OVERRIDES = st.one_of(
    st.text(max_size=40),
    st.builds(
        lambda k, sep, v: f"{k}{sep}{v}",
        st.one_of(st.sampled_from(DOTTED), MANGLED_KEYS),  # well-formed keys half the time
        st.sampled_from(["=", "=", "=", "==", ":", " = ", ""]),
        st.one_of(BAD_YAML, st.text(max_size=16), VALUES.map(_yaml)),
    ),
)


@PROPERTY
@given(command=st.sampled_from(sorted(COMMANDS)), override=OVERRIDES)
def test_malformed_key_value_text_is_refused_on_one_line_or_valid(command, override, workdir):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = _resolve(command, [override], workdir)
    except SystemExit as exc:  # argparse: the text is no KEY=VALUE at all
        assert exc.code == 1
        _assert_one_line(Exception(err.getvalue().strip()), "error:")
    except ValueError as exc:
        _assert_one_line(exc)
    else:
        _assert_valid(cfg)
    _no_work_done(workdir)


@PROPERTY
@given(command=st.sampled_from(sorted(COMMANDS)), override=OVERRIDES)
def test_malformed_key_value_text_in_the_config_loader(command, override):
    """The same text straight into `config_io.apply_overrides` (what `--set`-style callers use)."""
    base = RESOLVE_BASE[command]()
    try:
        cfg = config_io.apply_overrides(base, [override])
    except ValueError as exc:
        _assert_one_line(exc)
    else:
        _assert_valid(cfg)


def _finetune_base():
    from pipelines.tasks.finetuned import default_run

    return default_run("vqa", None)


def _pretrain_base():
    from pipelines.tasks.pretrain import PretrainRun

    return PretrainRun()


def _detector_base():
    from pipelines.tasks.detection import DetectorTrainRun

    return DetectorTrainRun()


RESOLVE_BASE = {
    "finetune": _finetune_base,
    "pretrain": _pretrain_base,
    "detector": _detector_base,
    "extract": ExtractConfig,
    "generate-tokenizer": TokenizerRun,
    "generate-train": TextToImageRun,
}


def _numeric(tp: typing.Any) -> bool:
    return tp in (int, float) or any(_numeric(a) for a in typing.get_args(tp))


@pytest.mark.parametrize(
    "cls",
    sorted({cls for _, _, cls, _ in KEYS} | {cls for cls, _ in MODEL_FIELDS}, key=lambda c: c.__name__),
    ids=lambda c: c.__name__,
)
def test_every_number_declares_its_range(cls):
    """A number without a declared range would pass the properties above whatever it is (a 0 that divides,
    a -1 that loops): each int and float field is in its class's RANGES."""
    hints = typing.get_type_hints(cls)
    ranges = getattr(cls, "RANGES", {})
    missing = [f.name for f in dataclasses.fields(cls) if _numeric(hints[f.name]) and f.name not in ranges]
    assert not missing, f"{cls.__name__} declares no range for {missing}"


@pytest.mark.slow  # a fresh interpreter each: 10-15 s on a busy 2-core machine
@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("task.model.num_attention_heads=-3", "task.model.num_attention_heads=-3 is out of range"),
        ("train.lr=[1, {a: ]", "refused YAML"),
        ("train.lr\n=1", "unrecognized arguments: train.lr\\n=1 (see xmodal --help)"),
    ],
)
def test_the_command_line_refuses_on_one_line_before_any_work(override, needle, tmp_path):
    """The whole CLI in its own process: exit 1, one line on stderr, no traceback, no run directory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = _argv("finetune", tmp_path / "run", [override])
    done = subprocess.run(
        [sys.executable, "-m", "pipelines.cli", *argv],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and needle in lines[0], done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []  # no run directory, no Ray session, no file at all
