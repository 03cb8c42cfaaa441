"""One lock: materializations, checkpoint loads and changes to finished deferrals run one at a time.

Several threads may ask for the same tensors at once (``materialize_module``
on a model and on its submodule, ``materialize_tensor`` on a parameter of
it, ``load_checkpoint`` meanwhile).  A call that decided what to compute
before another call's swap would dress a real tensor from an object that is
no longer the fake, or read attributes the swap took away.  So every call
that reads or changes a finished record takes :func:`exclusive` first and
decides what to do only then: the others wait and find their tensors done,
or do what is left still deferred.

Why one lock rather than one per record or per storage, and why it cannot
deadlock: docs/design.md, "Threads" (the graph crosses records; a replay
sets per-process state, the default dtype and default generators).  It is
re-entrant (a materialization inside a load hook, FSDP1's
``param_init_fn``, ``.item()`` while recording a change after deferral) and
the outermost of deferinit's locks: taken only where a public call starts
(or the recorder records a change to a finished deferral), never while
holding another, and by no finalizer (the collector runs finalizers in
whatever thread it interrupts, maybe one holding those).  The cost, two
unrelated models in two threads taking turns, is measured by
``benchmarks/threads.py``.

Not covered: a thread recording its own deferral appends to its record
without the lock (no other thread has its fakes yet; only the values it
reads, ``.item()``, ``get_rng_state()``, are computed under it).  Using a
tensor, or changing it from Python (``requires_grad_``, ``.data =``), while
another thread swaps it in is a race of the caller's, as with
``module.to()`` in another thread.

Example::

    >>> with exclusive():          # re-entrant: the calls inside take it again
    ...     m = materialize_module(deferred_init(torch.nn.Linear, 2, 2))
    >>> is_deferred(m)
    False
"""

from __future__ import annotations

import threading

# Looked up at each call (not bound at import), so that tests can watch it.
_LOCK = threading.RLock()


def exclusive():
    """The lock every reader and writer of a finished record holds, as a context
    manager (re-entrant within a thread)."""
    return _LOCK
