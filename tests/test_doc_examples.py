"""The ```python examples of README.md and docs/*.md run as a reader would run them.

Each page's blocks run in order, in one fresh Python process (a later block
may use what an earlier one made, as on the page), in a temporary directory,
offline.  A failure names the page and line.  ``docs/api.md`` is generated
from the docstrings, whose examples tests/test_doctests.py runs.

A block that cannot run here is marked by an HTML comment on the line right
before its fence, which the rendered page does not show:

* ``<!-- not run: REASON -->``: never run (a signature, a sketch that needs
  several processes, a package that is not a dependency);
* ``<!-- run if: dot -->``: run only where Graphviz's ``dot`` is installed
  (the conditions: ``dot``, and a package's name: ``transformers``,
  ``diffusers``, ``accelerate``, ``peft``, ``torchtitan``, ``lightning``, ``litgpt``,
  ``torchao``, ``bitsandbytes``, ``torchtune``).

See docs/testing.md.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
    if name.endswith(".md") and name != "api.md"
)
CONDITIONS = {
    "dot": lambda: shutil.which("dot") is not None,
    **{
        name: (lambda name=name: importlib.util.find_spec(name) is not None)
        for name in ("transformers", "diffusers", "accelerate", "peft", "torchtitan", "lightning", "litgpt",
                     "torchao", "bitsandbytes", "torchtune")
    },
}
_FENCE = re.compile(r"^```python\s*$")
_MARK = re.compile(r"^<!--\s*(not run|run if):\s*(.*?)\s*-->\s*$")


def python_blocks(text: str):
    """``(line, source, mark)`` for every ```python block: ``line`` is the 1-based
    line of its first code line, ``mark`` ``(kind, argument)`` or None."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            mark = _MARK.match(lines[i - 1]) if i else None
            start = i + 1
            end = start
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            yield start + 1, "\n".join(lines[start:end]), (mark.group(1), mark.group(2)) if mark else None
            i = end
        i += 1


def _runnable(page: str):
    with open(os.path.join(ROOT, page)) as f:
        blocks = list(python_blocks(f.read()))
    run, skipped = [], []
    for line, source, mark in blocks:
        if mark is None:
            run.append((line, source))
            continue
        kind, arg = mark
        if kind == "not run":
            assert arg, f"{page}:{line}: `<!-- not run: REASON -->` needs a reason"
            skipped.append((line, arg))
        elif kind == "run if":
            assert arg in CONDITIONS, f"{page}:{line}: unknown condition {arg!r} (known: {', '.join(CONDITIONS)})"
            if CONDITIONS[arg]():
                run.append((line, source))
            else:
                skipped.append((line, arg))
    return run, skipped


# Runs the blocks with their page's line numbers, so a traceback points into the page.
_DRIVER = """
import sys
page, blocks = sys.argv[1], eval(sys.stdin.read())
namespace = {"__name__": "__main__"}
for line, source in blocks:
    code = compile("\\n" * (line - 1) + source, page, "exec")
    exec(code, namespace)
"""


def test_every_page_with_examples_is_listed():
    assert "README.md" in PAGES and os.path.join("docs", "guide.md") in PAGES


def test_the_marks_are_read():
    page = "text\n<!-- not run: needs two ranks -->\n```python\nx = 1\n```\n```python\ny = 2\n```\n"
    blocks = list(python_blocks(page))
    assert blocks == [(4, "x = 1", ("not run", "needs two ranks")), (7, "y = 2", None)]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("page", PAGES)
def test_python_examples_run(page, tmp_path):
    run, skipped = _runnable(page)
    if not run:
        pytest.skip(f"{page} has no runnable ```python block")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.pop("DEFERINIT_PROGRESS", None)
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, page], input=repr(run), cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"an example of {page} failed:\n{proc.stderr[-4000:]}"
