"""One lock: materializations, checkpoint loads and changes to finished deferrals run one at a time.

Several threads may ask for the same tensors at once: two threads calling
``materialize_module`` on one model, one on a model and one on its
submodule, ``materialize_tensor`` on a parameter while its module is being
materialized, ``load_checkpoint`` meanwhile.  Each such call computes its
real tensors from the record and swaps them into the fake objects; a call
that decided what to compute before another call's swap would dress a real
tensor from an object that is no longer the fake (a ``Parameter`` coming
out a plain ``Tensor``), or read attributes the swap took away.  So every
call that reads or changes a finished record takes :func:`exclusive` first
and decides what to do only then: one call materializes, the others wait
for it and find their tensors done (no longer deferred, so no longer
asked for), or find what is left still deferred and do that.

**Why one lock, not one per record or per storage.**

* What a call touches is known only by walking the graph, and the graph
  crosses records: a record's tensors may be computed from another's
  (``Record.parents``), its random streams may continue an earlier
  record's (two models deferred back to back draw one stream of the
  default generator, ``Stream.after``, and replay caches the states it
  passes on that stream), and a storage materialized by one call is read
  by its views in later calls (``Storage.real``).  Per-record locks would
  be chosen from the graph before holding them, while a thread recording
  a change after deferral may be adding a parent: take, check, retake.
* A replay changes what is one per process, whichever record it replays:
  the default dtype, set per node as it was when the node was recorded
  (c10's default dtype is a process global, not per thread); a device's
  default generator, borrowed for an operator that takes no ``generator``
  argument; and at the end the default generators handed over to where
  eager construction left them.  Two replays of unrelated records side by
  side would see each other's default dtype.
* The cost is that materializations which could run side by side (two
  unrelated models in two threads) run one after the other.  A replay is
  bound by memory bandwidth or by the device, and its kernels already use
  torch's intra-op threads, so little is lost
  (``benchmarks/threads.py`` measures it).

**No deadlock.**  There is one lock, and it is re-entrant: a call made
while it is held in the same thread (a materialization inside a load hook,
FSDP1's ``param_init_fn``, a value computed for ``.item()`` while
recording a change after deferral) goes through.  It is the outermost of
deferinit's locks: taken only where a public call starts (or the recorder
records a change to a finished deferral), never while holding another
(the seeding log's, the generator chains', the patches', the pending
draws'), and no finalizer takes it (the collector runs finalizers in
whatever thread it interrupts, maybe one holding those).

**Not covered.**  A thread recording its own deferral appends to its own
record without the lock (no other thread has its fakes before
``deferred_init`` returns); only the values it reads (``.item()``,
``get_rng_state()``) are computed under it.  Using a tensor (a forward
pass, ``.shape``) while another thread swaps it in is a race of the
caller's, as with ``module.to()`` in another thread; so are Python-level
changes (``requires_grad_``, ``.data =``) to a tensor another thread is
materializing.

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
