"""The manual's promises: every shell block runs here or is marked with what it needs (and its commands
parse), the demo's figures equal the demo's own report, benchmark figures equal BENCHMARKS.md's JSON lines,
and no page names an issue."""

from __future__ import annotations

import html
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pipelines.cli import build_parser, main
from tests.docs.pages import DOCS, NEEDS, PAGES, README, REPO, Block, shell_blocks, xmodal_commands

UNMARKED = [b for b in shell_blocks() if b.marker is None]


def test_every_shell_block_runs_here_or_says_what_it_needs() -> None:
    blocks = shell_blocks()
    assert len(blocks) > 30 and UNMARKED, "the pages lost their shell blocks"
    for block in blocks:
        if block.marker is None:
            continue
        kind, value = block.marker
        if kind == "needs":
            assert value in NEEDS, f"{block.name}: unknown need {value!r} (one of {sorted(NEEDS)})"
        else:
            runner = REPO / value
            assert runner.is_file(), f"{block.name}: {value} does not exist"
            assert block.page.name in runner.read_text(), f"{value} does not read {block.page.name}"


@pytest.mark.parametrize("block", shell_blocks(), ids=lambda b: b.name)
def test_the_commands_of_a_block_parse(block: Block) -> None:
    for argv in xmodal_commands(block.text):
        if "--help" in argv:
            with pytest.raises(SystemExit) as done:
                build_parser().parse_args(argv)
            assert done.value.code == 0, (block.name, argv)
            continue
        args = build_parser().parse_args(argv)
        assert args.command == argv[0], (block.name, argv)


def test_the_pages_show_every_job() -> None:
    names = {argv[0] for block in shell_blocks() for argv in xmodal_commands(block.text)}
    assert {"extract", "pretrain", "finetune", "evaluate", "ask", "submit", "features", "convert", "serve",
            "score", "generate", "detector", "vocab"} <= names  # fmt: skip


@pytest.fixture(scope="module")
def store_folder(tmp_path_factory) -> Path:
    """A folder holding `feats.lmdb`: six images of up to 10 regions of 32 float16 features, with labels."""
    from storage import FeatureWriter, RegionFeatures

    root = tmp_path_factory.mktemp("blocks")
    rng = np.random.default_rng(0)
    with FeatureWriter(root / "feats.lmdb", feature_dim=32, max_boxes=10, meta={"detector": "docs"}) as w:
        for i in range(6):
            n, (h, w_) = int(rng.integers(1, 11)), (int(rng.integers(64, 200)), int(rng.integers(64, 200)))
            x1, y1 = rng.uniform(0, w_ / 2, n), rng.uniform(0, h / 2, n)
            boxes = np.stack([x1, y1, x1 + rng.uniform(1, w_ / 2, n), y1 + rng.uniform(1, h / 2, n)], 1)
            w.put(
                RegionFeatures(
                    img_id=f"COCO_val2014_{i:012d}", img_h=h, img_w=w_, boxes=boxes.astype(np.float32),
                    features=rng.uniform(0, 4, (n, 32)).astype(np.float16).astype(np.float32),
                    objects_id=rng.integers(0, 1600, n), objects_conf=rng.random(n, dtype=np.float32),
                    attrs_id=rng.integers(0, 400, n), attrs_conf=rng.random(n, dtype=np.float32),
                )
            )  # fmt: skip
    return root


@pytest.mark.parametrize("block", UNMARKED, ids=lambda b: b.name)
def test_an_unmarked_block_runs_as_written(block: Block, store_folder, tmp_path, monkeypatch, capsys) -> None:
    """Each line in order, in a copy of a folder holding `feats.lmdb`: `xmodal` lines through the CLI's
    `main` (exit status 0), any other line through bash."""
    import shutil

    folder = tmp_path / "here"
    shutil.copytree(store_folder, folder)
    monkeypatch.chdir(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for line in block.text.replace("\\\n", " ").splitlines():
        if not line.split("#", 1)[0].strip():
            continue
        commands = xmodal_commands(line)
        if commands:
            assert main(commands[0]) == 0, (block.name, line, capsys.readouterr().err[-2000:])
        else:
            done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, (block.name, line, done.stderr[-2000:])
    from storage import FeatureReader

    if "merged.lmdb" in block.text:  # the store block ends in a merge of its two imports
        assert sorted(FeatureReader(folder / "merged.lmdb").keys()) == sorted(
            FeatureReader(folder / "feats.lmdb").keys()
        )


# --- the demo's figures ---------------------------------------------------------------------------------

HEADLINE = re.compile(r"^<!-- demo-headline -->\n(.*?)^<!-- /demo-headline -->$", re.M | re.S)
# figures the demo reports, which vary with the machine: a page names the report's rows, never their values
DEMO_FIGURE = re.compile(r"\d+(\.\d+)? ?%|CIDEr-D \d|AP50 \d|\d+ of \d+ test")


def _report_rows() -> list[str]:
    """The labels of the demo report's headline rows, rendered by the report's own code from a summary of
    the keys the demo writes; counts as N, the question types as one row."""
    from pipelines.apps.demo.probe import PROBED
    from pipelines.apps.demo.report import _headline

    summary = {
        "detector": {"AP50": 0.9, "AP": 0.6},
        "probe": {"held_out_regions": 7, **{f"{k}_accuracy": 0.5 for k in PROBED}},
        "accuracy": 90.0, "prior_baseline_accuracy": 40.0, "baseline_accuracy": 20.0,
        "per_type_accuracy": {"how many": 80.0}, "per_type_prior_baseline": {"how many": 30.0},
        "other_images_accuracy": 30.0,
        "caption": {"agreement": {"names_every_shape": 40.0}, "test_images": 7, "cider_d": 500.0,
                    "baseline_agreement": {"names_every_shape": 2.0}, "baseline_cider_d": 90.0},
    }  # fmt: skip
    labels = [html.unescape(k).strip() for k in re.findall(r"<tr><th>(.*?)</th>", _headline(summary))]
    return [re.sub(r"\b\d+\b", "N", label).replace("“how many …”", "“(question type) …”") for label in labels]


@pytest.mark.parametrize("page", [README, DOCS / "install.md"], ids=lambda p: p.name)
def test_a_page_names_the_rows_the_demo_report_shows(page: Path) -> None:
    (table,) = HEADLINE.findall(page.read_text())
    rows = [line.strip().strip("|").split("|")[0].strip() for line in table.strip().splitlines()[2:]]
    assert rows == _report_rows()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_copies_a_demo_figure(page: Path) -> None:
    """The demo's figures are those of the reader's machine (demo_run/report.html): a page that speaks of
    the demo states none of them; figures of a benchmark on the demo's scenes carry their source."""
    text = re.sub(r"[\d.,]+<!-- bench: \S+ \S+ -->", "", page.read_text())
    for number, line in enumerate(text.splitlines(), 1):
        if "demo" in line.lower():
            assert not DEMO_FIGURE.search(line), f"{page.name}:{number}: {line}"


# --- benchmark figures ----------------------------------------------------------------------------------

BENCH = re.compile(r"([\d.,]+)<!-- bench: (\S+) (\S+) -->")


def benchmark_lines() -> list[dict]:
    """Every JSON line of BENCHMARKS.md (each benchmark names itself with `name`, older ones `bench`)."""
    text = (REPO / "BENCHMARKS.md").read_text()
    found = [json.loads(m) for m in re.findall(r'`(\{"(?:name|bench)": .*?\})`', text)]
    assert len(found) > 20
    return found


def _lookup(line: dict, dotted: str):
    value = line
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_benchmark_figures_come_from_a_json_line(page: Path) -> None:
    lines = benchmark_lines()
    for shown, name, key in BENCH.findall(page.read_text()):
        decimals = len(shown.split(".")[1]) if "." in shown else 0
        values = [_lookup(x, key) for x in lines if name in (x.get("name"), x.get("bench"))]
        assert any(
            isinstance(v, (int, float)) and round(float(v), decimals) == float(shown.replace(",", ""))
            for v in values
        ), f"{page.name}: {shown} is not {name}'s {key} in BENCHMARKS.md ({values})"


def test_the_benchmarks_page_cites_json_lines() -> None:
    assert len(BENCH.findall((DOCS / "benchmarks.md").read_text())) >= 20


# --- what the pages say -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "page", [*PAGES, REPO / "CHANGELOG.md", REPO / "storage" / "FORMAT.md"], ids=lambda p: p.name
)
def test_no_page_names_an_issue(page: Path) -> None:
    assert not re.search(r"\bissues?[ -]#?\d+|#\d{2,}\b", page.read_text(), re.I), page.name


def test_every_page_is_in_the_site() -> None:
    import yaml

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]

    def files(entry) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        if isinstance(entry, list):
            return [f for e in entry for f in files(e)]
        return [f for v in entry.values() for f in files(v)]

    assert sorted(files(nav)) == sorted(p.name for p in DOCS.glob("*.md"))
