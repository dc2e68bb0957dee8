"""Every `xmodal ...` line in the README's shell blocks parses with the real command-line parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pipelines.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands() -> list[list[str]]:
    """`xmodal` argument lists from ```bash blocks: continuations joined, comments, pipes and `;` split off,
    lines eliding arguments with `...` left out, and the command after `submit ... --` listed on its own."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\||;|\|", line):
                words = shlex.split(part, comments=True)
                words = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]  # VAR=value prefixes
                if (
                    words[:1] != ["xmodal"] or "..." in words
                ):  # `xmodal pretrain ... --resume` elides on purpose
                    continue
                commands.append(words[1:])
                if words[1:2] == ["submit"] and "--" in words:
                    commands.append(words[words.index("--") + 1 :])
    return commands


def test_the_readme_shows_commands() -> None:
    names = {argv[0] for argv in readme_commands()}
    assert {"extract", "pretrain", "finetune", "evaluate", "ask", "submit", "features", "convert"} <= names


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda a: " ".join(a)[:60])
def test_readme_command_parses(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.command == argv[0]
