"""Drawing the record of a 70B model: ``to_dot`` and SVG rendering.

The record of ``deferinit.demo.Llama`` at Llama 3 70B sizes, drawn
collapsed (80 identical decoder layers as one block, the default) and
expanded.  Rendering needs Graphviz's ``dot``; without it only ``to_dot``
is timed.

Run: ``python benchmarks/render_graph.py`` (prints markdown).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine, table, timed  # noqa: E402
from deferinit import deferred_init, to_dot  # noqa: E402
from deferinit.demo import LLAMA_70B, Llama  # noqa: E402


def main(repeat: int = 3) -> str:
    import torch

    model = deferred_init(Llama, LLAMA_70B, dtype=torch.bfloat16)
    has_dot = shutil.which("dot") is not None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, expand in (("collapsed (x80)", False), ("expanded", True)):
            draw, _, graph = timed(lambda: to_dot(model, expand=expand), repeat=repeat)
            nodes = graph.source.count("label=")
            if has_dot:
                path = os.path.join(tmp, "g")
                render, _, _ = timed(lambda: graph.render(path, format="svg", cleanup=True), repeat=repeat)
                size = os.path.getsize(path + ".svg")
                rows.append([label, nodes, f"{draw:.2f} s", f"{render:.2f} s", f"{size / 2**10:,.0f} KiB"])
            else:
                rows.append([label, nodes, f"{draw:.2f} s", "(no dot)", ""])
    return "\n".join(
        [
            f"Machine: {machine()}",
            "",
            table(["record of Llama-70B", "drawn items", "to_dot", "dot -Tsvg", "SVG size"], rows),
            "",
            f"Best of {repeat} runs each.",
        ]
    )


if __name__ == "__main__":
    print(main())
