"""Foreach operators over DTensors, run in chunks while a step is planned.

DTensor's sharding propagation of a foreach operator (``_foreach_add_``,
``_foreach_addcdiv_``, ... what ``torch.optim`` runs with ``foreach=True``)
rebuilds the whole operator's schema once per list element, so its cost
grows with the square of the list's length: a foreach AdamW step over the
723 parameters of a 70B Llama sharded with FSDP2 spends about 20 s of CPU in
it, on the first step of a real run as in a plan.  A foreach operator acts
on each element on its own, so running it over consecutive chunks of its
lists gives the same tensors, allocated in the same order with nothing freed
in between: the memory trackers see the same allocations and the same peak,
and no FLOP formula counts foreach operators.  Planning runs the optimizer's
foreach calls on DTensor lists that way (:class:`ChunkedForeach`, entered by
``deferinit.cli.step.measure_step``); the plan's figures are the real
step's (``tests/deferinit/test_plan_foreach.py`` compares them with the
unchunked step).

Example::

    >>> len(dtensors)
    7
    >>> with ChunkedForeach(chunk=2):
    ...     out = torch._foreach_mul(dtensors, 2.0)   # calls of 2, 2, 2 and 1 DTensors
    >>> len(out)
    7
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

#: Elements per call: DTensor's cost per call grows as chunk x length of the call,
#: its fixed cost per call is a few hundred microseconds.
CHUNK = 16


def _is_dtensor_list(value) -> bool:
    if not isinstance(value, (list, tuple)) or not value:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value[0], DTensor)


class ChunkedForeach(TorchFunctionMode):
    """Runs ``torch._foreach_*`` and ``torch._fused_*`` calls whose first list holds
    DTensors in chunks of ``chunk`` elements; everything else passes through.

    Every list argument of the call's length is cut the same way (tensor lists
    and scalar lists alike); other arguments go to each chunk unchanged.  The
    results of an out-of-place operator are joined in order.
    """

    def __init__(self, chunk: int = CHUNK) -> None:
        super().__init__()
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        self.chunk = chunk

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not (name.startswith("_foreach_") or name.startswith("_fused_")) or not args:
            return func(*args, **kwargs)
        first = args[0]
        if not _is_dtensor_list(first) or len(first) <= self.chunk:
            return func(*args, **kwargs)
        n = len(first)

        def cut(value, lo, hi):
            return value[lo:hi] if isinstance(value, (list, tuple)) and len(value) == n else value

        results = []
        for lo in range(0, n, self.chunk):
            hi = lo + self.chunk
            results.append(func(*(cut(a, lo, hi) for a in args), **{k: cut(v, lo, hi) for k, v in kwargs.items()}))
        if all(r is None for r in results):
            return None
        joined = [t for r in results for t in r]
        return type(results[0])(joined) if isinstance(results[0], tuple) else joined
