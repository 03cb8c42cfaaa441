"""What accelerate's dispatch_model costs on a deferred model, whose tensors become real one by one.

dispatch_model asks each tensor it hooks for its ``data_ptr()``, and a
deferred tensor asked for its address becomes real in place
(``materialize_tensor``): dispatching a deferred model materializes it
tensor by tensor, in accelerate's order, instead of in one
``materialize_module``.  Columns: eager construction then dispatch_model;
deferred_init, materialize_module, then dispatch_model; deferred_init, then
dispatch_model (each tensor made real when asked) and materialize_module for
what it did not ask.  The device map hooks every module on the CPU
(``force_hooks=True``).  Figures are seconds (best of 3 rounds, the columns
in turn in each round) and the ratio to materializing first.

Run: ``python benchmarks/dispatch.py`` (prints markdown).
"""

from __future__ import annotations

import logging
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine, table, timed_together  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from deferinit import deferred_init  # noqa: E402
from deferinit.materialize import materialize_module  # noqa: E402


def _stack(width: int, depth: int) -> nn.Module:
    return nn.Sequential(*(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width)) for _ in range(depth)))


def main(width: int = 1024, depths=(24, 200)) -> str:
    import accelerate

    logging.getLogger("accelerate").setLevel(logging.ERROR)  # "you shouldn't move a model..." per call

    def dispatch(model):
        accelerate.dispatch_model(model, device_map={"": "cpu"}, force_hooks=True)

    rows = []
    for depth in depths:
        def eager():
            torch.manual_seed(0)
            dispatch(_stack(width, depth))

        def materialize_first():
            torch.manual_seed(0)
            model = deferred_init(_stack, width, depth)
            materialize_module(model)
            dispatch(model)

        def dispatch_deferred():
            torch.manual_seed(0)
            model = deferred_init(_stack, width, depth)
            dispatch(model)
            materialize_module(model)

        found = timed_together({"eager": eager, "first": materialize_first, "deferred": dispatch_deferred}, repeat=3)
        base = found["first"][0]
        tensors = 4 * depth
        rows.append([f"{depth} blocks ({tensors} tensors)"] + [f"{found[k][0]:.3f}" for k in ("eager", "first", "deferred")]
                    + [f"{found['deferred'][0] / base:.2f}x"])
    return (
        f"Machine: {machine()}; torch intra-op threads: {torch.get_num_threads()}.\n"
        f"Blocks of LayerNorm({width}) + Linear({width}, {width}), on CPU.\n\n"
        + table(["model", "eager, then dispatch_model", "materialize_module, then dispatch_model",
                 "dispatch_model on the deferred model", "vs materializing first"], rows)
    )


if __name__ == "__main__":
    print(main())
