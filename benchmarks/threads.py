"""What one lock for every materialization costs two threads.

deferinit/exclusive.py serializes materializations process-wide.  Two
unrelated models (seeded apart, so no record needs the other's) are
materialized: one after the other in one thread; from two threads at once
(the lock makes them take turns); from two threads with the lock taken away
(what side-by-side replays would give here; not safe in general, see
exclusive.py); and the same model from two threads (the second finds it
done).  Each column defers both models and materializes them; eager
construction of both is the reference.  Figures are seconds (best of 5
rounds, the columns in turn in each round) and the ratio to one thread.

Run: ``python benchmarks/threads.py`` (prints markdown).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine, table, timed_together  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import deferinit.exclusive as exclusive  # noqa: E402
from deferinit import deferred_init  # noqa: E402
from deferinit.materialize import materialize_module  # noqa: E402



class Stack(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )


def _pair(width, depth):
    torch.manual_seed(1)
    a = deferred_init(Stack, width, depth)
    torch.manual_seed(2)
    b = deferred_init(Stack, width, depth)
    return a, b


def _threads(*calls):
    threads = [threading.Thread(target=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def _unlocked():
    saved = exclusive._LOCK
    exclusive._LOCK = _NoLock()
    try:
        yield
    finally:
        exclusive._LOCK = saved


def main(width: int = 1024, depth: int = 6) -> str:
    def eager():
        torch.manual_seed(1)
        Stack(width, depth)
        torch.manual_seed(2)
        Stack(width, depth)

    def one_thread():
        a, b = _pair(width, depth)
        materialize_module(a)
        materialize_module(b)

    def two_threads():
        a, b = _pair(width, depth)
        _threads(lambda: materialize_module(a), lambda: materialize_module(b))

    def two_threads_unlocked():
        a, b = _pair(width, depth)
        with _unlocked():
            _threads(lambda: materialize_module(a), lambda: materialize_module(b))

    def same_model():
        a, b = _pair(width, depth)
        _threads(lambda: materialize_module(a), lambda: materialize_module(a))
        materialize_module(b)

    columns = {
        "eager, both models": eager,
        "one thread, one after the other": one_thread,
        "two threads, one model each": two_threads,
        "two threads, lock taken away": two_threads_unlocked,
        "two threads on one model, then the other": same_model,
    }
    found = timed_together(columns, repeat=5)
    base = found["one thread, one after the other"][0]
    rows = [[name, f"{best:.3f}", f"{best / base:.2f}x"] for name, (best, _, _) in found.items()]
    params = sum(p.numel() for p in Stack(width, 1).parameters()) * depth
    return (
        f"Machine: {machine()}; torch intra-op threads: {torch.get_num_threads()}.\n"
        f"Two models of {params / 1e6:.0f}M parameters each ({depth} blocks of width {width}), on CPU.\n\n"
        + table(["deferring and materializing both", "seconds (best of 5)", "vs one thread"], rows)
    )


if __name__ == "__main__":
    print(main())
