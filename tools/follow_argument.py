"""Follow ``materialize_module`` through the project's files, call by call.

Runs ``materialize_module`` on a deferred model under a trace function and
lists, in call order, the project files it enters: every call (the whole
path of the work), and the calls that receive the module itself as an
argument.  For each path it prints how many files it passes through, how
many times it goes back up the import order (a call into a file that
imports, directly or not, the file it came from), and how many times it
re-enters a file it had left.  Issue 28 measures the layout by these
numbers; lower is easier to follow.

    python tools/follow_argument.py            # a Transformer, materialize_module
    python tools/follow_argument.py --show     # and the path, file by file
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("fake", "deferinit", "materialize")


def _project_file(path: str) -> str | None:
    path = os.path.abspath(path)
    if not path.startswith(ROOT + os.sep):
        return None
    rel = os.path.relpath(path, ROOT)
    return rel if rel.split(os.sep)[0] in PACKAGES else None


def _module_of(rel: str) -> str:
    parts = rel[:-3].split(os.sep)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] in ("fake", "materialize"):
        parts.insert(0, "deferinit")
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """``file -> files it imports`` among the project's files."""
    files = {}
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, name), ROOT)
                    files[_module_of(rel)] = rel
    graph = {}
    for module, rel in files.items():
        tree = ast.parse(open(os.path.join(ROOT, rel)).read())
        package = module if rel.endswith("__init__.py") else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and files[name] != rel:
                    found.add(files[name])
        graph[rel] = found
    return graph


def _above(graph) -> dict[str, set[str]]:
    """``file -> files that import it, directly or not``."""
    reach: dict[str, set[str]] = {}

    def deps(f, seen):
        if f in reach:
            return reach[f]
        out = set()
        for g in graph.get(f, ()):
            if g not in seen:
                out |= {g} | deps(g, seen | {g})
        reach[f] = out
        return out

    for f in graph:
        deps(f, {f})
    above: dict[str, set[str]] = {f: set() for f in graph}
    for f, ds in reach.items():
        for d in ds:
            above.setdefault(d, set()).add(f)
    return above


def follow(obj, call) -> tuple[list[str], list[str]]:
    """The project files ``call`` enters, in call order: every call, and those
    whose functions get ``obj`` as an argument (repeats in a row count once)."""
    every: list[str] = []
    holding: list[str] = []

    def tracer(frame, event, arg):
        if event != "call":
            return None
        rel = _project_file(frame.f_code.co_filename)
        if rel is None:
            return None
        if not every or every[-1] != rel:
            every.append(rel)
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount
        values = [frame.f_locals.get(name) for name in code.co_varnames[:n]]
        if any(v is obj for v in values) and (not holding or holding[-1] != rel):
            holding.append(rel)
        return None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return every, holding


def measure(path: list[str], graph) -> dict:
    above = _above(graph)
    ups = sum(1 for a, b in zip(path, path[1:]) if b in above.get(a, ()))
    seen, reentries = set(), 0
    for f in path:
        if f in seen:
            reentries += 1
        seen.add(f)
    return {"files": len(seen), "up": ups, "reentries": reentries, "path": path}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--show", action="store_true", help="print the path, one file per line")
    args = parser.parse_args(argv)
    import torch

    from deferinit import deferred_init, materialize_module

    graph = import_graph()
    for name, ctor in [("Linear(4, 4)", lambda: torch.nn.Linear(4, 4)),
                       ("Transformer(32, 2, 1, 1, 64)", lambda: torch.nn.Transformer(32, 2, 1, 1, 64))]:
        torch.manual_seed(0)
        model = deferred_init(ctor)
        every, holding = follow(model, lambda: materialize_module(model))
        for what, path in (("every call", every), ("calls given the module", holding)):
            r = measure(path, graph)
            print(f"{name}, {what}: {r['files']} files, back up the import order {r['up']} times, "
                  f"re-enters a file it had left {r['reentries']} times")
            if args.show:
                print("  " + "\n  ".join(path))


if __name__ == "__main__":
    main()
