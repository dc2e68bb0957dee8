"""The house rules of pipelines/: imports go down the layers only, there are no import cycles, and no
task name is compared outside the task table."""

from __future__ import annotations

import ast
from pathlib import Path

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
# commands -> apps -> tasks | jobs -> data | scoring | engine -> model
LAYERS = {
    "cli": 5,
    "commands": 5,
    "__main__": 5,
    "apps": 4,
    "tasks": 3,
    "jobs": 3,
    "data": 2,
    "engine": 2,
    "scoring": 2,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PIPELINES.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every pipelines module and the pipelines modules it imports (at any depth of the file)."""
    graph: dict[str, set[str]] = {}
    for path in PIPELINES.rglob("*.py"):
        name = _module_name(path)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipelines"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("pipelines"))
        graph[name] = found
    return {k: {m for m in v if m in graph and m != k} for k, v in graph.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_subpackage_has_a_layer():
    assert {p.stem if p.is_file() else p.name for p in PIPELINES.iterdir() if p.name != "__pycache__"} - {
        "__init__"
    } <= set(LAYERS)


def test_imports_only_go_down_or_sideways():
    upward = [
        (a, b)
        for a, deps in _imports().items()
        for b in deps
        if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)
    ]
    assert upward == []


def test_no_import_cycles():
    graph = _imports()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep] if dep in stack else [node, dep])
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package importing its own submodules (pipelines.tasks -> pipelines.tasks.qa) is not a cycle
    # unless the submodule imports the package back, which the walk above does report
    assert cycles == []


def test_no_task_name_compared_outside_the_table():
    from pipelines.tasks import TASKS

    hits = []
    for path in PIPELINES.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    if isinstance(side, ast.Constant) and side.value in TASKS:
                        hits.append(f"{path.relative_to(PIPELINES)}:{node.lineno}")
    assert hits == []
