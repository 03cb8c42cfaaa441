"""What the toolkit's patches of ``torch`` cost code that is not deferred.

Two kinds of patches: ``torch.Tensor.data`` and ``set_`` (fake/assign.py),
installed while any fake is alive (fake/alive.py), and the random
functions and methods diverted while a deferral may still warn that its
draws are pending (deferinit/random/pending.py).  (``_make_subclass`` is diverted
only inside a fake mode: not measured here.)
Each column is its own fresh process: PyTorch alone; the packages imported
and no fake made; while a fake is alive (``fake_mode``); after the last fake
was collected (PyTorch's own functions again); while a deferred model's draws are
pending (the random calls use a generator of their own, so the deferral
keeps watching); after that deferral warned once (it stops watching).
Figures are nanoseconds per call (best of 5) and the ratio to PyTorch alone.

Run: ``python benchmarks/patch_overhead.py`` (prints markdown).
Child mode (used internally): ``python benchmarks/patch_overhead.py child STATE``.
"""

from __future__ import annotations

import json
import os
import sys
import timeit

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine, run_child, table  # noqa: E402

STATES = ["torch alone", "imported, no fake", "a fake made", "last fake gone", "draws pending", "after the warning"]

CALLS = {
    "t.data": "a.data",
    "t.data = u": "a.data = b",
    "p.data = u (Parameter)": "p.data = b",
    "t.set_(u)": "a.set_(b)",
    "nn.Parameter(t)": "torch.nn.Parameter(b)",
    "torch.randn(16, generator=g)": "torch.randn(16, generator=g)",
    "t.uniform_(generator=g)": "a.uniform_(generator=g)",
    "torch.randn(16)": "torch.randn(16)",
}
# Calls that would move the default generator (and end the pending window).
DEFAULT_DRAWS = {"torch.randn(16)"}


def child(state: str) -> None:
    import warnings

    import torch

    warnings.simplefilter("ignore")
    keep = []
    if state != "torch alone":
        import deferinit  # noqa: F401
        import deferinit.materialize  # noqa: F401
    if state in ("a fake made", "last fake gone"):
        from deferinit.fake import fake_mode

        with fake_mode():
            keep.append(torch.ones(2))
        if state == "last fake gone":
            keep.clear()
    if state in ("draws pending", "after the warning"):
        from deferinit import deferred

        with deferred():
            keep.append(torch.nn.Linear(64, 64))
    if state == "after the warning":
        torch.rand(1)
    scope = {
        "torch": torch,
        "a": torch.zeros(16),
        "b": torch.ones(16),
        "p": torch.nn.Parameter(torch.zeros(16)),
        "g": torch.Generator().manual_seed(0),
    }
    results = {}
    for name, stmt in CALLS.items():
        if state == "draws pending" and name in DEFAULT_DRAWS:
            results[name] = None
            continue
        n = 20000
        best = min(timeit.repeat(stmt, number=n, repeat=5, globals=scope)) / n
        results[name] = best * 1e9
    print(json.dumps(results))


def main() -> str:
    figures = {state: run_child(__file__, "child", state) for state in STATES}
    base = figures["torch alone"]
    rows = []
    for name in CALLS:
        row = [name]
        for state in STATES:
            v = figures[state][name]
            row.append("-" if v is None else f"{v:,.0f} ({v / base[name]:.2f}x)")
        rows.append(row)
    return f"Machine: {machine()}\n\n" + table(["call (ns)", *STATES], rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2])
    else:
        print(main())
