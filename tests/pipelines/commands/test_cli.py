"""The `xmodal` dispatcher: every listed command that exists is reachable and parses its help."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from pipelines.cli import COMMANDS, build_parser, main

PRESENT = [name for name, _ in COMMANDS if importlib.util.find_spec(f"pipelines.commands.{name}")]


def test_top_level_help_lists_every_present_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in PRESENT:
        assert name in out


@pytest.mark.parametrize("name", PRESENT)
def test_each_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert "usage: xmodal " + name in capsys.readouterr().out


def test_finetune_summary_names_every_fine_tuning_task():
    from pipelines.tasks import TASKS

    summary = dict(COMMANDS)["finetune"]
    tasks = [name for name in TASKS if name != "pretrain"]
    assert tasks and all(name in summary for name in tasks), (summary, tasks)


def test_unknown_command_is_an_error():
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["no-such-command"])
    assert exc.value.code == 1  # bad input (EXIT_CODES)


def test_python_dash_m_entry_point_matches_console_script():
    proc = subprocess.run([sys.executable, "-m", "pipelines", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "convert" in proc.stdout


@pytest.fixture(scope="module")
def release_file(tmp_path_factory):
    """A tiny pre-training checkpoint in the original release layout (`module.bert.*`), 4 QA answers."""
    import torch

    from model import LxmertConfig, LxmertForPreTraining, to_hf_state

    cfg = LxmertConfig.preset("tiny", vocab_size=30, visual_feat_dim=8, num_qa_labels=4)
    torch.manual_seed(0)
    hf = to_hf_state(LxmertForPreTraining(cfg).state_dict(), cfg, "LxmertForPreTraining")
    path = tmp_path_factory.mktemp("release") / "Epoch20_LXRT.pth"
    torch.save({"module." + k.replace("lxmert.", "bert.", 1): v for k, v in hf.items()}, path)
    return path


def _one_line_error(capsys, argv: list[str], *expected: str) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


def test_convert_lxmert_writes_the_answer_table_beside_the_weights(release_file, tmp_path, capsys):
    import json

    answers = tmp_path / "all_ans.json"
    answers.write_text(json.dumps([{"ans": a, "dsets": ["vqa"]} for a in ("yes", "no", "2", "red")]))
    assert (
        main(["convert", "lxmert", str(release_file), str(tmp_path / "out"), "--answers", str(answers)]) == 0
    )
    assert json.loads((tmp_path / "out" / "ans2label.json").read_text()) == {
        "yes": 0,
        "no": 1,
        "2": 2,
        "red": 3,
    }
    assert "4-answer table" in capsys.readouterr().out
    answers.write_text(json.dumps(["yes", "no", "2"]))
    _one_line_error(
        capsys,
        ["convert", "lxmert", str(release_file), str(tmp_path / "out3"), "--answers", str(answers)],
        str(release_file),
        "4 answers but the answer table 3",
    )
    assert not (tmp_path / "out3").exists(), "nothing is written for a table of the wrong size"


def test_convert_lxmert_errors_are_one_line_naming_the_file(release_file, tmp_path, capsys):
    import torch

    missing = tmp_path / "nowhere.pth"
    _one_line_error(
        capsys, ["convert", "lxmert", str(missing), str(tmp_path / "a")], str(missing), "does not exist"
    )
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"not a checkpoint" * 8)
    _one_line_error(
        capsys, ["convert", "lxmert", str(corrupt), str(tmp_path / "b")], str(corrupt), "cannot be read"
    )
    other = tmp_path / "resnet.pth"
    torch.save({"conv1.weight": torch.zeros(2, 3)}, other)
    _one_line_error(
        capsys, ["convert", "lxmert", str(other), str(tmp_path / "c")], str(other), "no LXMERT backbone"
    )
    state = torch.load(release_file, weights_only=True)
    partial = tmp_path / "partial.pth"
    torch.save({k: v for k, v in state.items() if ".intermediate." not in k}, partial)
    _one_line_error(capsys, ["convert", "lxmert", str(partial), str(tmp_path / "d")], str(partial), "missing")
    # a fine-tuned QA file (no pre-training heads) whose answer head lost its output layer
    headless = tmp_path / "headless.pth"
    torch.save(
        {
            k: v
            for k, v in state.items()
            if "bert." in k or "answer_head.logit_fc.0" in k or "logit_fc.2" in k
        },
        headless,
    )
    _one_line_error(
        capsys,
        ["convert", "lxmert", str(headless), str(tmp_path / "g")],
        str(headless),
        "answer_head.logit_fc.3.weight",
    )
    no_arch = tmp_path / "no_arch"
    no_arch.mkdir()
    (no_arch / "config.json").write_text('{"format": "xmodal-lxmert", "config": {}}')
    (no_arch / "model.safetensors").write_bytes(b"")
    _one_line_error(capsys, ["convert", "lxmert", str(no_arch), str(tmp_path / "h")], "architecture")
    broken_dir = tmp_path / "broken_dir"
    broken_dir.mkdir()
    (broken_dir / "config.json").write_text("{not json")
    _one_line_error(capsys, ["convert", "lxmert", str(broken_dir), str(tmp_path / "e")], str(broken_dir))
    answers = tmp_path / "answers.json"
    answers.write_text("[1, 2")
    _one_line_error(
        capsys,
        ["convert", "lxmert", str(release_file), str(tmp_path / "f"), "--answers", str(answers)],
        str(answers),
        "not valid JSON",
    )


def test_convert_detector_errors_are_one_line_naming_the_file(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    missing = tmp_path / "nowhere.pkl"
    _one_line_error(capsys, ["convert", "detector", str(missing), str(tmp_path / "a.st")], str(missing))
    corrupt = tmp_path / "corrupt.pkl"
    corrupt.write_bytes(b"\x80\x02garbage")
    _one_line_error(capsys, ["convert", "detector", str(corrupt), str(tmp_path / "b.st")], str(corrupt))
    wrong = tmp_path / "wrong.safetensors"
    save_file({"backbone.stem.conv1.weight": torch.zeros(2, 2), "not.a.detector": torch.zeros(1)}, str(wrong))
    err = _one_line_error(
        capsys,
        ["convert", "detector", str(wrong), str(tmp_path / "c.safetensors")],
        str(wrong),
        "unexpected",
        "--no-strict",
    )
    assert re.search(
        r": \d+ missing, 1 unexpected, 1 mismatched \(-v lists them\); fix the checkpoint", err
    ), err
    assert not (tmp_path / "c.safetensors").exists()


def test_convert_to_hf_writes_a_directory_transformers_uses_as_it_is(release_file, tmp_path, capsys):
    """Tokenizer files and id2label/label2id: AutoTokenizer knows the words, the config names the answers."""
    import json

    from transformers import AutoTokenizer, LxmertConfig

    answers = tmp_path / "all_ans.json"
    answers.write_text(json.dumps(["yes", "no", "2", "red"]))
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(t + "\n" for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS)))
    out = tmp_path / "hf"
    _one_line_error(
        capsys, ["convert", "lxmert", str(release_file), str(out), "--to-hf"], "has no vocab.txt", "--vocab"
    )
    argv = ["convert", "lxmert", str(release_file), str(out), "--to-hf", "--vocab", str(vocab)]
    assert main([*argv, "--answers", str(answers)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.tokenize("The red ball") == ["the", "red", "ball"]
    assert tokenizer("red")["input_ids"] == [2, 5 + WORDS.index("red"), 3]
    config = LxmertConfig.from_pretrained(out)
    assert config.id2label == {0: "yes", 1: "no", 2: "2", 3: "red"}
    assert config.label2id == {"yes": 0, "no": 1, "2": 2, "red": 3}
    # and back: a HuggingFace directory's vocabulary comes along, so `finetune --init back` uses it
    assert main(["convert", "lxmert", str(out), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "vocab.txt").read_text() == (out / "vocab.txt").read_text()


WORDS = ("the", "red", "ball", "is", "on", "a", "table", "what", "color", "of", "man", "dog")


def test_version_is_the_installed_packages(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"xmodal {version('xmodal')}"


def _device_defaults(parser, path=()):
    """(command path, --device default) for every parser and sub-parser that has a --device option."""
    import argparse

    for action in parser._actions:
        if "--device" in action.option_strings:
            yield " ".join(path), action.default
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _device_defaults(child, (*path, name))


def test_every_device_option_has_the_same_default():
    import torch

    from pipelines.engine.devices import pick_device
    from pipelines.engine.trainer import TrainConfig

    found = dict(_device_defaults(build_parser()))
    assert {"ask", "evaluate", "serve", "detector evaluate"} <= set(found), found
    assert set(found.values()) == {"auto"}, found
    assert TrainConfig().device == "auto"
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device("auto").type == expected
    assert pick_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'gpu' is not a device"):
        pick_device("gpu")
