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
and no FLOP formula counts foreach operators.

DTensor caches a propagation by the chunk's specs, so chunks follow the
list's period where it has one (a model's parameters repeat layer by layer):
a 70B Llama's lists of 723 are cut into the embedding, 80 layers of 9 and the
head, 3 distinct chunks per operator instead of the 11 that cuts of 16 give,
each propagated once.  Planning runs the optimizer's
foreach calls on DTensor lists that way (:class:`ChunkedForeach`, entered by
``deferinit.planning.step.measure_step``); the plan's figures are the real
step's (``tests/deferinit/test_plan_foreach.py`` compares them with the
unchunked step).

Example::

    >>> from torch.distributed.tensor import Replicate, distribute_tensor
    >>> from deferinit.planning import fake_ranks
    >>> with fake_ranks(2, 0, "cpu") as mesh:
    ...     dtensors = [distribute_tensor(torch.full((4,), float(i)), mesh, [Replicate()]) for i in range(7)]
    ...     with ChunkedForeach(chunk=2):
    ...         out = torch._foreach_mul(dtensors, 2.0)   # calls of 2, 2, 2 and 1 DTensors
    ...     [t.to_local()[0].item() for t in out]
    [0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0]
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

#: Elements per call: DTensor's cost per call grows as chunk x length of the call,
#: its fixed cost per call is a few hundred microseconds.
CHUNK = 16
#: The longest period looked for in a list (a layer's parameter count).
MAX_PERIOD = 64


def _plain(lo: int, hi: int, chunk: int) -> list:
    return [(a, min(a + chunk, hi)) for a in range(lo, hi, chunk)]


def bounds(kinds, chunk: int = CHUNK) -> list:
    """``[(lo, hi), ...]``: consecutive chunks of at most ``chunk`` covering a list
    whose elements are of ``kinds`` (equal kinds: equal specs), cut on the
    list's period where one repeats at least three times, else every ``chunk``.

    Example::

        >>> bounds([0, 1, 2, 3, 1, 2, 3, 1, 2, 3, 4], chunk=4)   # head, 3 periods of 3, tail
        [(0, 1), (1, 4), (4, 7), (7, 10), (10, 11)]
        >>> bounds([5, 6, 7, 8, 9], chunk=2)   # no period
        [(0, 2), (2, 4), (4, 5)]
    """
    n = len(kinds)
    best, period = 0, 0
    for p in range(1, min(MAX_PERIOD, n // 3) + 1):
        matches = sum(1 for i in range(n - p) if kinds[i] == kinds[i + p])
        if matches > best:
            best, period = matches, p
    if period == 0 or best < 2 * period:
        return _plain(0, n, chunk)
    start = next((i for i in range(n - 2 * period + 1) if kinds[i:i + period] == kinds[i + period:i + 2 * period]), None)
    if start is None:
        return _plain(0, n, chunk)
    unit = kinds[start:start + period]
    end = start
    while kinds[end:end + period] == unit:
        end += period
    if period <= chunk:
        step = period * (chunk // period)
        middle = [(a, min(a + step, end)) for a in range(start, end, step)]
    else:  # each period cut the same way
        middle = [c for a in range(start, end, period) for c in _plain(a, a + period, chunk)]
    return _plain(0, start, chunk) + middle + _plain(end, n, chunk)


def _same_layout(first, lists) -> bool:
    """Whether each DTensor of ``lists`` is laid out as the element of ``first`` at
    its index: else DTensor redistributes every element of that list before the
    local operator runs, all at once unchunked but a chunk at a time chunked, and
    the chunked step's peak would be lower than the real step's."""
    from torch.distributed.tensor import DTensor

    for values in lists:
        for t, u in zip(first, values):
            if isinstance(u, DTensor) and (u.placements != t.placements or u.device_mesh != t.device_mesh):
                return False
    return True


def _is_dtensor_list(value) -> bool:
    if not isinstance(value, (list, tuple)) or not value:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value[0], DTensor)


class ChunkedForeach(TorchFunctionMode):
    """Runs ``torch._foreach_*`` and ``torch._fused_*`` calls whose first list holds
    DTensors in chunks of at most ``chunk`` elements, cut on the list's period
    (:func:`bounds`); everything else passes through.

    Every list argument of the call's length is cut the same way (tensor lists
    and scalar lists alike); other arguments go to each chunk unchanged.  A call
    whose other DTensor lists are laid out unlike the first runs whole
    (:func:`_same_layout`).  The results of an out-of-place operator are
    joined in order.
    """

    def __init__(self, chunk: int = CHUNK) -> None:
        super().__init__()
        if chunk < 1:
            raise ValueError(f"chunk must be at least 1, got {chunk}")
        self.chunk = chunk
        self._bounds: dict = {}  # kinds of a list -> its chunks

    def _cuts(self, dtensors) -> list:
        numbering: dict = {}
        kinds = tuple(numbering.setdefault(t._spec, len(numbering)) for t in dtensors)
        cuts = self._bounds.get(kinds)
        if cuts is None:
            cuts = self._bounds[kinds] = bounds(kinds, self.chunk)
        return cuts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not (name.startswith("_foreach_") or name.startswith("_fused_")) or not args:
            return func(*args, **kwargs)
        first = args[0]
        if not _is_dtensor_list(first) or len(first) <= self.chunk:
            return func(*args, **kwargs)
        n = len(first)
        lists = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, (list, tuple)) and len(a) == n]
        if not _same_layout(first, lists):
            return func(*args, **kwargs)

        def cut(value, lo, hi):
            return value[lo:hi] if isinstance(value, (list, tuple)) and len(value) == n else value

        results = []
        for lo, hi in self._cuts(first):
            results.append(func(*(cut(a, lo, hi) for a in args), **{k: cut(v, lo, hi) for k, v in kwargs.items()}))
        if all(r is None for r in results):
            return None
        joined = [t for r in results for t in r]
        return type(results[0])(joined) if isinstance(results[0], tuple) else joined
