"""The layout stays as docs/design.md draws it: imports point one way
(materialize -> deferinit -> fake, the planner and the command line on
top), no file imports itself back through others, and every file holds one
idea, said by its docstring's first line (a file far beyond ~800 lines is a
smell worth a look, not a rule)."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("fake", "deferinit", "materialize")
SMELL_LINES = 800
# Files that sit on top of all three layers: the front door re-exports and
# wires them; the planner is a library built on them, and the command line
# an application of them and of the planner.
PLANNING = "deferinit/planning/"
CLI = "deferinit/cli/"
TOP = ("deferinit/__init__.py", "deferinit/__main__.py", PLANNING, CLI)
# What the planner builds on: the fake layer, the front doors of the other
# two layers, and the text helpers every report shares.
PLANNING_BUILDS_ON = ("fake/", "deferinit/__init__.py", "materialize/__init__.py", "deferinit/text.py")


def _files():
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(folder, name), ROOT)


def _module_of(path: str) -> str:
    parts = path[:-3].split(os.sep)
    if parts[0] in ("fake", "materialize"):  # installed inside deferinit (pyproject.toml)
        parts.insert(0, "deferinit")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: str, files: dict) -> set[str]:
    """The project files ``path`` imports, at module level or inside functions."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read(), path)
    module = _module_of(path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule file when there is one.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and files[name] != path:
                found.add(files[name])
    return found


@pytest.fixture(scope="module")
def graph():
    files = {_module_of(p): p for p in _files()}
    return {path: _imports(path, files) for path in files.values()}


def _find_cycle(graph: dict) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(path):
        state[path] = 1
        stack.append(path)
        for other in sorted(graph[path]):
            if state.get(other) == 1:
                return stack[stack.index(other):] + [other]
            if other not in state:
                cycle = visit(other)
                if cycle:
                    return cycle
        stack.pop()
        state[path] = 2
        return None

    for path in sorted(graph):
        if path not in state:
            cycle = visit(path)
            if cycle:
                return cycle
    return None


def test_no_import_cycles_between_files(graph):
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("lower, upper", [("fake", "deferinit"), ("fake", "materialize"), ("deferinit", "materialize")])
def test_imports_point_one_way(graph, lower, upper):
    wrong = [
        f"{path} imports {other}"
        for path, others in graph.items()
        if path.startswith(lower + os.sep) and not path.startswith(TOP)
        for other in others
        if other.startswith(upper + os.sep)
    ]
    assert not wrong, "; ".join(wrong)


def test_the_planner_sits_between_the_layers_and_the_command_line(graph):
    # deferinit.planning is a library of its own: it imports the layers only
    # through what PLANNING_BUILDS_ON names, never the command line, and only
    # the command line imports it (importing deferinit does not import
    # PyTorch's trackers).
    wrong = [
        f"{path} imports {other}"
        for path, others in graph.items()
        if path.startswith(PLANNING)
        for other in others
        if not other.startswith((PLANNING, *PLANNING_BUILDS_ON))
    ]
    wrong += [
        f"{path} imports {other}"
        for path, others in graph.items()
        if not path.startswith((PLANNING, CLI))
        for other in others
        if other.startswith(PLANNING)
    ]
    assert not wrong, "; ".join(wrong)


def test_every_file_says_its_idea():
    # One idea per file, named by the first line of its docstring: a file is
    # split when it holds two ideas, not when it passes a line count.
    silent, long = [], []
    for path in _files():
        with open(os.path.join(ROOT, path)) as f:
            text = f.read()
        doc = ast.get_docstring(ast.parse(text, path)) or ""
        if not doc.strip():
            silent.append(path)
        if text.count("\n") > SMELL_LINES:
            long.append(f"{path} ({text.count(chr(10))} lines)")
    assert not silent, "no docstring saying the file's idea: " + ", ".join(silent)
    assert not long, "over ~800 lines: is this one idea? " + ", ".join(long)
