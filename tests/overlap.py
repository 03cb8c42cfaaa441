"""Forcing two or more calls from different threads to overlap, whatever the scheduler does.

:func:`overlapped` runs a *first* call in one thread and the *other* calls
in threads of their own.  The first call stops at the first of ``points``
it reaches (functions of the library, replaced for the run by wrappers), so
it is inside its work: deciding what to compute, computing, before the
swap.  Only then do the others start, and the first call goes on once
each of them has got as far as it can while the first is inside: waiting
for deferinit's lock (:mod:`deferinit.exclusive`, watched for the run),
at one of ``points`` itself, or finished.  An other call at a point stays
there until the first call has returned, so that whatever it decided
before is used after the first call's changes.  Without the lock the
others run into the first call's work; with it they wait for it.

Nothing depends on timing: every wait is for an event, bounded by
:data:`TIMEOUT` (a failure, not a hang).
"""

from __future__ import annotations

import threading

TIMEOUT = 60


class _Watched:
    """The lock of :mod:`deferinit.exclusive`, telling when a thread is about to wait for it."""

    def __init__(self, lock, waiting):
        self._lock = lock
        self._waiting = waiting

    def __enter__(self):
        if not self._lock.acquire(blocking=False):  # another thread holds it
            self._waiting()
            self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()
        return False


class _Run:
    def __init__(self, others: int):
        self.first = None
        self.first_inside = threading.Event()
        self.first_done = threading.Event()
        self.arrived = threading.Semaphore(0)
        self.others = others
        self.local = threading.local()
        self.errors: list = []

    def arrive(self) -> None:
        """This (other) thread got as far as it can while the first call is inside."""
        if getattr(self.local, "role", None) == "other" and not getattr(self.local, "arrived", False):
            self.local.arrived = True
            self.arrived.release()

    def at_point(self) -> None:
        role = getattr(self.local, "role", None)
        if role == "first" and not self.first_inside.is_set():
            self.first_inside.set()
            for _ in range(self.others):
                if not self.arrived.acquire(timeout=TIMEOUT):
                    raise AssertionError("an overlapping call never got into the first call's work")
        elif role == "other":
            self.arrive()
            if not self.first_done.wait(TIMEOUT):
                raise AssertionError("the first call never finished")


def _wrap(fn, run: _Run):
    def wrapper(*args, **kwargs):
        run.at_point()
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


def overlapped(monkeypatch, first, others, points) -> None:
    """Run ``first()`` and each of ``others`` (callables) in threads of their own,
    overlapping as the module docstring says; re-raise the first failure.

    ``points`` are ``(owner, name)`` pairs: attributes (functions or methods)
    where a call is inside its work.  The first call must reach one of them.
    """
    import deferinit.exclusive as exclusive

    run = _Run(len(others))
    with monkeypatch.context() as patch:
        for owner, name in points:
            patch.setattr(owner, name, _wrap(getattr(owner, name), run))
        patch.setattr(exclusive, "_LOCK", _Watched(exclusive._LOCK, run.arrive))

        def body(fn, role):
            def go():
                run.local.role = role
                try:
                    if role == "other" and not run.first_inside.wait(TIMEOUT):
                        raise AssertionError("the first call never reached one of the points")
                    fn()
                except BaseException as e:  # noqa: BLE001 - reported in the main thread
                    run.errors.append(e)
                finally:
                    if role == "first":
                        run.first_done.set()
                        run.first_inside.set()  # a first call that failed early releases the others
                    else:
                        run.arrive()
            return go

        threads = [threading.Thread(target=body(first, "first"), daemon=True)]
        threads += [threading.Thread(target=body(fn, "other"), daemon=True) for fn in others]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT * 3)
            assert not t.is_alive(), "a thread hung"
    if run.errors:
        raise run.errors[0]

