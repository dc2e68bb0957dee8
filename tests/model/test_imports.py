"""model/ imports only torch, safetensors and the standard library, and its modules form no cycle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MODEL = Path(__file__).resolve().parents[2] / "model"
ALLOWED_THIRD_PARTY = {"torch", "safetensors"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(MODEL.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import in `path`, relative ones resolved."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
                # `from . import pretrained` imports a submodule, not a name.
                targets = [f"{module}.{a.name}" for a in node.names] if not node.module else [module]
            else:
                targets = [node.module]
            found += [(t, id(node) in top_level) for t in targets]
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in MODEL.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target, _ in _imports(path):
            while target and target not in modules:  # `from .lxmert.config import X` -> the module
                target = target.rpartition(".")[0]
            if target.startswith("model") and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def test_only_torch_safetensors_and_stdlib_are_imported():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for path in MODEL.rglob("*.py"):
        for target, top in _imports(path):
            root = target.split(".")[0]
            if root in stdlib or root == "model" or root in ALLOWED_THIRD_PARTY:
                continue
            # transformers is only a converter's lazy, optional import
            assert root == "transformers" and not top, f"{path.relative_to(MODEL.parent)} imports {target}"


def test_no_import_cycles():
    graph = _graph()
    # A package imports its own modules; a module importing its package's __init__ is not an edge back.
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt) :] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert "model.architectures" in graph["model"] and "model.pretrained" in graph["model.lxmert.modeling"]
