"""Writes docs/api.md from the docstrings of the public API.

The reference is generated so that it cannot drift from the code;
``tests/test_docs.py`` fails when docs/api.md is out of date.  Run:
``python docs/make_api.py``.
"""

from __future__ import annotations

import inspect
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# (module, names) in the order the page shows them.
PUBLIC = [
    ("deferinit", ["deferred_init", "deferred", "is_deferred", "graph_of", "to_dot"]),
    ("deferinit.view", ["Graph"]),
    ("deferinit.materialize", ["materialize_module", "materialize_tensor", "load_checkpoint", "LoadResult"]),
    ("deferinit.fake", ["fake_mode", "is_fake", "meta_like", "FakeTensor", "FakeStorage"]),
    (
        "deferinit",
        [
            "DeferredInitError",
            "RecordingError",
            "MixedFakeError",
            "DeferredWriteError",
            "DeferredModuleWarning",
            "PendingDrawsWarning",
            "InferenceTensorInputError",
            "DataDependentError",
            "MaterializationError",
            "ExternalTensorMutatedError",
            "DeviceUnavailableError",
            "ReplayError",
            "CheckpointError",
            "CheckpointMismatchError",
            "CheckpointNotFoundError",
            "CheckpointReadError",
        ],
    ),
    ("deferinit.fake", ["FakeTensorError", "FakeDataAccessError", "FakeIntoRealError", "UnsupportedOperatorError"]),
    ("deferinit.dot", ["write", "GraphViewError", "GraphvizNotFoundError", "GraphFormatError"]),
    ("deferinit.collectives", ["CollectiveError"]),
    ("deferinit.materialize.distributed", ["param_init_fn", "fsdp1_hooks", "sharded_memory_cost", "fsdp_held_fakes"]),
    (
        "deferinit.planning",
        [
            "plan_step",
            "measure_step",
            "Recipe",
            "Measured",
            "fake_ranks",
            "Timeline",
            "timeline_svg",
            "timeline_html",
            "FakeProcessGroupError",
        ],
    ),
]


def _signature(obj) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return sig


def render() -> str:
    import importlib

    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `docs/make_api.py`; do not edit by hand.",
        "",
    ]
    for module_name, names in PUBLIC:
        module = importlib.import_module(module_name)
        for name in names:
            obj = getattr(module, name)
            kind = "class" if inspect.isclass(obj) else "function"
            public_module = module_name
            if kind == "class" and issubclass(obj, BaseException):
                base = obj.__mro__[1].__name__
                out.append(f"## `{public_module}.{name}({base})`")
            elif kind == "class" and name[:1].islower():
                # Named and used as a call (a context manager): its signature, as a function's.
                call = _signature(obj).removesuffix(" -> 'None'")
                out.append(f"## `{public_module}.{name}{call}`")
            elif kind == "class":
                out.append(f"## `{public_module}.{name}`")
            else:
                out.append(f"## `{public_module}.{name}{_signature(obj)}`")
            out.append("")
            doc = inspect.getdoc(obj) or "(no docstring)"
            out.append(_markdown(doc))
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def _markdown(doc: str) -> str:
    """Docstring to markdown: ``Example::`` blocks become fenced code."""
    lines = doc.splitlines()
    out = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::"):
            text = line.rstrip()[:-2].rstrip()
            if text:
                out.append(text + ":")
            out.append("")
            out.append("```python")
            i += 1
            while i < len(lines) and not lines[i].strip():
                i += 1
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
                out.append(lines[i][4:] if lines[i].startswith("    ") else "")
                i += 1
            while out[-1] == "":
                out.pop()
            out.append("```")
            out.append("")
            continue
        out.append(line)
        i += 1
    return "\n".join(out).strip()


PATH = os.path.join(HERE, "api.md")

if __name__ == "__main__":
    with open(PATH, "w") as f:
        f.write(render())
    print(f"wrote {PATH}")
