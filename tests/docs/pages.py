"""The README and the manual's pages as the doc tests read them: code blocks with their markers, and the
`xmodal` commands of a shell block."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# what a block that cannot run in a test needs; its `xmodal` commands are parsed instead
NEEDS = {"gpu", "cluster", "weights", "data", "docker", "server", "time"}
MARKER = re.compile(r"<!-- (needs|run-by): (\S+) -->")
FENCE = re.compile(r"^(\s*)```(\S*)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    marker: tuple[str, str] | None  # ("needs", "gpu") or ("run-by", "tests/...py")
    text: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, its lines unindented, with the marker on the line above it (if any)."""
    lines = page.read_text().split("\n")
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, start = len(m.group(1)), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        above = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.fullmatch(above)
        text = "\n".join(line[indent:] for line in lines[start + 1 : end])
        found.append(Block(page, start + 1, m.group(2), marker.groups() if marker else None, text + "\n"))
        i = end + 1
    return found


def shell_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang in ("bash", "sh", "shell", "console")]


def xmodal_commands(text: str) -> list[list[str]]:
    """`xmodal` argument lists of a shell block: continuations joined, comments, pipes and `;` split off,
    `VAR=value` prefixes dropped, and the command after `submit ... --` listed on its own."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        for part in re.split(r"&&|\|\||;|\|", line):
            words = [w for w in shlex.split(part, comments=True) if not re.fullmatch(r"[A-Z_]+=.*", w)]
            if words[:1] != ["xmodal"] or "..." in words:  # `xmodal pretrain ... --resume` elides on purpose
                continue
            commands.append(words[1:])
            if words[1:2] == ["submit"] and "--" in words:
                commands.append(words[words.index("--") + 1 :])
    return commands
