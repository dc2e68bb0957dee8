"""The `xmodal` dispatcher: every listed command that exists is reachable and parses its help."""

from __future__ import annotations

import importlib.util
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


def test_unknown_command_is_an_error():
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["no-such-command"])
    assert exc.value.code == 2


def test_python_dash_m_entry_point_matches_console_script():
    proc = subprocess.run([sys.executable, "-m", "pipelines", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "convert" in proc.stdout
