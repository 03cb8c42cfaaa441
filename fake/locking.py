"""A lock held for exactly one call: released whatever interrupts the call.

``with lock:`` followed by an indented body has a window: on the way out of
the body the interpreter reaches the ``with`` line again before it calls the
lock's ``__exit__``, and a ``KeyboardInterrupt`` raised there (a trace
function's line event; a signal handler at that instruction) is outside the
block's exception table, so the lock stays held and the next thread that
asks for it waits for ever.  Written on one line, ``with lock: return
fn()``, the frame has no line of its own between acquiring and releasing:
every interrupt arrives inside ``fn``'s frame, covered by the block, and
``__exit__`` runs.  Every lock of the project that guards more than one
statement is taken through :func:`locked` (tests/test_interrupts.py checks
that no lock is left held after any trial).
"""

from __future__ import annotations

import functools


def locked(lock, fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` holding ``lock``, released however the call ends.

    Example::

        >>> import threading
        >>> lock = threading.Lock()
        >>> locked(lock, lambda x: x + 1, 1), lock.locked()
        (2, False)
    """
    with lock: return fn(*args, **kwargs)  # noqa: E701 - one line: no interruptible line between enter and exit


def holding(attribute: str):
    """A method decorator: the method runs under ``self.<attribute>`` through :func:`locked`.

    Example::

        >>> import threading
        >>> class Counter:
        ...     def __init__(self):
        ...         self._lock, self.n = threading.Lock(), 0
        ...     @holding("_lock")
        ...     def bump(self):
        ...         self.n += 1
        ...         return self._lock.locked()
        >>> Counter().bump()
        True
    """

    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            return locked(getattr(self, attribute), method, self, *args, **kwargs)

        return call

    return wrap
