"""``deferinit demo``: defer a Llama-3-70B-shaped model, inspect it, draw it,
materialize one block and check it bit for bit against eager PyTorch."""

from __future__ import annotations

import sys
import time

import torch

from deferinit.materialize import materialize_module

from .. import dot
from ..demo import SHAPES, Llama, eager_first_block
from ..session import deferred_init, is_deferred
from ..text import fmt_bytes, fmt_count, fmt_seconds
from .report import format_report, summarize
from .targets import peak_rss_bytes, rss_bytes


def run_demo(*, size: str = "70b", seed: int = 0, output: str = "deferinit-demo.svg", out=None) -> int:
    """``deferinit demo``: defer a Llama-shaped model, inspect it, draw it, check one block.

    Returns the exit status: 0 when the materialized block equals eager
    construction bit for bit, 1 otherwise.

    Example::

        >>> run_demo(size="tiny", output="/tmp/demo.dot")
        0
    """
    out = out if out is not None else sys.stdout
    shape = SHAPES[size]
    dtype = torch.bfloat16
    started = time.perf_counter()
    name = {"70b": "LLAMA_70B", "tiny": "LLAMA_TINY"}[size]
    call = f"deferinit.demo:Llama({name}, dtype=torch.bfloat16)"

    def say(text=""):
        print(text, file=out, flush=True)

    say(f"deferinit demo: a Llama-3-{size.upper()}-shaped model in plain torch.nn")
    say(f"({shape.describe()}), bfloat16, seed {seed}")
    say()

    # 1. Defer.
    torch.manual_seed(seed)
    rss_before = rss_bytes()
    t0 = time.perf_counter()
    model = deferred_init(Llama, shape, dtype=dtype)
    deferral = time.perf_counter() - t0
    grown = rss_bytes() - rss_before
    n_params = sum(p.numel() for p in model.parameters())
    say(
        f"1. Defer: deferred_init(Llama, {name}, dtype=torch.bfloat16) took {fmt_seconds(deferral)}; "
        f"resident memory grew by {fmt_bytes(max(grown, 0))},"
    )
    say(
        f"   for {fmt_count(n_params)} parameters that would take {fmt_bytes(n_params * dtype.itemsize)}."
    )
    say()

    # 2. Inspect.
    say("2. Inspect (what `deferinit inspect` prints):")
    say("   " + format_report(summarize(model), deferral, title=call, grown=grown).replace("\n", "\n   "))
    say()

    # 3. Draw.
    t0 = time.perf_counter()
    graph = dot.to_dot(model)
    try:
        written = dot.write(graph, output)
        say(
            f"3. Draw: wrote {written} in {fmt_seconds(time.perf_counter() - t0)}: the record of the whole model, "
            f"its {shape.num_layers} identical decoder layers drawn as one block marked x{shape.num_layers}."
        )
    except dot.GraphvizNotFoundError as e:
        say(f"3. Draw: {e}")
    say()

    # 4. Materialize one block and compare with eager PyTorch.
    block = model.layers[0]
    t0 = time.perf_counter()
    materialize_module(block, device="cpu")
    replayed = time.perf_counter() - t0
    block_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
    say(
        f"4. Check: materialize_module(model.layers[0], device='cpu') took {fmt_seconds(replayed)} for "
        f"{fmt_bytes(block_bytes)}"
    )
    say("   (the embedding's draws, which come first, were replayed to reach the generator state, then freed).")
    t0 = time.perf_counter()
    eager = eager_first_block(shape, seed=seed, dtype=dtype)
    eager_time = time.perf_counter() - t0
    mine = dict(block.named_parameters())
    theirs = dict(eager.named_parameters())
    same = mine.keys() == theirs.keys() and all(
        mine[n].dtype == p.dtype and torch.equal(mine[n], p) for n, p in theirs.items()
    )
    say(
        f"   Eager PyTorch (torch.manual_seed({seed}); nn.Embedding; DecoderLayer) took {fmt_seconds(eager_time)}: "
        f"the {len(theirs)} tensors are {'bit-identical' if same else 'DIFFERENT'}."
    )
    del eager
    say()
    say(
        f"Done in {fmt_seconds(time.perf_counter() - started)}, peak resident memory "
        f"{fmt_bytes(peak_rss_bytes())}; the other {sum(1 for p in model.parameters() if is_deferred(p))} "
        "tensors are still deferred."
    )
    return 0 if same else 1
