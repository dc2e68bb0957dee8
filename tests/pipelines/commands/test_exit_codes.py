"""One exit-status table for every command: 0 ok, 1 bad input or refusal, 2 partial failure."""

from __future__ import annotations

import pytest

from pipelines.cli import COMMANDS, EXIT_BAD_INPUT, EXIT_CODES, EXIT_OK, EXIT_PARTIAL, main


def test_the_table_is_in_the_top_level_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == EXIT_OK
    out = capsys.readouterr().out
    assert "exit status" in out and EXIT_CODES.splitlines()[1].strip() in out
    assert (EXIT_OK, EXIT_BAD_INPUT, EXIT_PARTIAL) == (0, 1, 2)


@pytest.mark.parametrize("name", [name for name, _ in COMMANDS])
def test_usage_errors_are_bad_input(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main([name, "--no-such-option"])
    assert exc.value.code == EXIT_BAD_INPUT
    assert "error:" in capsys.readouterr().err


def test_missing_files_are_bad_input(tmp_path):
    missing = str(tmp_path / "missing")
    common = ["--features", missing, "--train", missing, "--out", str(tmp_path / "run")]
    assert main(["finetune", "vqa", *common]) == EXIT_BAD_INPUT
    assert main(["pretrain", *common]) == EXIT_BAD_INPUT
    evaluate = ["--checkpoint", missing, "--features", missing, "--split", missing, "--out", missing]
    assert main(["evaluate", "vqa", *evaluate]) == EXIT_BAD_INPUT
    assert main(["ask", missing, "why?", "--checkpoint", missing]) == EXIT_BAD_INPUT
    assert main(["convert", "lxmert", missing, str(tmp_path / "out")]) == EXIT_BAD_INPUT
    assert main(["vocab", "build", missing, "--out", str(tmp_path / "v.txt")]) == EXIT_BAD_INPUT
    assert main(["features", "info", missing]) == EXIT_BAD_INPUT
    assert main(["extract", missing, "--out", str(tmp_path / "f.lmdb")]) == EXIT_BAD_INPUT
