"""A distributed checkpoint of many small chunks: ``dcp.load`` against ``load_checkpoint``
(part of ``benchmarks/checkpoint.py``).

A module of 8,000 parameters of 16 floats, saved by ``dcp.save`` from one
process: 8,000 chunks, each a ``torch.save`` archive, and a ``.metadata``
that lists them.  What is timed is what grows with the number of chunks:
reading the metadata and every chunk.  Each arm runs in a fresh process,
the arms in turns (``--repeat`` rounds, medians):

* ``dcp.load``: into the eager module's ``state_dict()`` (``no_dist``);
* ``load_checkpoint``: into the same eager module (real tensors: every
  chunk read within the call);
* ``load_checkpoint`` into a deferred module: the call alone (headers read,
  loads recorded); its materialization is shown apart, as it is
  dominated by planning the replay of 8,000 independent tensors, which is
  not the checkpoint's.

Run alone: ``python benchmarks/checkpoint_chunks.py [--repeat 3] [--chunks 8000]``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import run_child, table  # noqa: E402

ARMS = {
    "dcp": "`dcp.load` into the eager module",
    "real": "`load_checkpoint` into the eager module",
    "deferred": "`load_checkpoint` into a deferred module (the call)",
}


def build(n: int):
    import torch
    import torch.nn as nn

    m = nn.Module()
    m.p = nn.ParameterList(nn.Parameter(torch.randn(16)) for _ in range(n))
    return m


def child(arm: str, folder: str, n: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from deferinit import deferred_init
    from deferinit.materialize import load_checkpoint, materialize_module

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    m = deferred_init(build, n) if arm == "deferred" else build(n)
    start = time.perf_counter()
    if arm == "dcp":
        dcp.load(m.state_dict(), checkpoint_id=folder, no_dist=True)
    else:
        load_checkpoint(m, folder)
    seconds = time.perf_counter() - start
    materialize = None
    if arm == "deferred":
        start = time.perf_counter()
        materialize_module(m)
        materialize = time.perf_counter() - start
    checksum = float(sum(p.detach().double().sum() for p in m.parameters()))
    return {"seconds": seconds, "materialize": materialize, "checksum": checksum}


def chunks_table(root: str, n: int = 8000, repeat: int = 3) -> str:
    import torch
    import torch.distributed.checkpoint as dcp

    folder = os.path.join(root, "chunks")
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(build(n).state_dict(), checkpoint_id=folder, no_dist=True)
    runs = {arm: [] for arm in ARMS}
    for _ in range(repeat):
        for arm in ARMS:  # in turns: a busy moment of the shared machine hits every arm
            runs[arm].append(run_child(os.path.abspath(__file__), "child", arm, folder, str(n)))
    ref = statistics.median(r["seconds"] for r in runs["dcp"])
    rows = []
    for arm, label in ARMS.items():
        seconds = statistics.median(r["seconds"] for r in runs[arm])
        same = all(abs(r["checksum"] - runs["dcp"][0]["checksum"]) < 1e-6 for r in runs[arm])
        rows.append([label, f"{seconds:.2f} s", f"{seconds / ref:.2f}x",
                     f"{statistics.median(r['materialize'] for r in runs[arm]):.2f} s" if arm == "deferred" else "",
                     "yes" if same else "NO"])
    metadata = os.path.getsize(os.path.join(folder, ".metadata"))
    return "\n".join([
        f"A distributed checkpoint of {n:,} chunks (`dcp.save` of {n:,} parameters of 16 floats from one process; "
        f"`.metadata` {metadata / 1e3:,.0f} KB), each arm a fresh process, in turns; medians of {repeat}:",
        "",
        table(["way", "time", "time / dcp.load", "then materialize_module", "same values as dcp.load"], rows),
    ])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    else:
        repeat = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 3
        n = int(sys.argv[sys.argv.index("--chunks") + 1]) if "--chunks" in sys.argv else 8000
        with tempfile.TemporaryDirectory() as root:
            print(chunks_table(root, n, repeat))
