"""Threads: recording is per thread, the global patch is shared safely.

One thread defers a model while others build real models and materialize
deferred ones.  Barriers inside the deferred constructor hold the recording
open while the other thread works, so the interleaving is certain, not
left to the scheduler.  Each thread must see only its own modes; the
``nn.init._no_grad_trunc_normal_`` diversion (deferinit/patches.py,
reference counted) is installed exactly while some thread records, and
diverts nothing but deferred fakes: real ``trunc_normal_`` in other threads
keeps working.  All results are compared with eager construction.

The default CPU generator is one object for all threads, in eager PyTorch
as here: two threads drawing from it interleave in an order nobody
controls.  So only one thread at a time uses it; the others draw from their
own ``torch.Generator`` (recorded as streams of their own).
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from deferinit import deferred_init, is_deferred
from deferinit import patches
from deferinit.session import current_record
from deferinit.fake import is_fake
from helpers import assert_same_tensors
from deferinit.materialize import materialize_module

TIMEOUT = 60  # seconds a barrier waits before the test fails instead of hanging
_ORIGINAL_TRUNC_NORMAL = nn.init._no_grad_trunc_normal_


def _patched() -> bool:
    return nn.init._no_grad_trunc_normal_ is not _ORIGINAL_TRUNC_NORMAL


def _modes():
    return len(_get_current_function_mode_stack()), len(_get_current_dispatch_mode_stack())


class DefaultGenModel(nn.Module):
    """Draws from the default generator; calls ``hook`` while being built."""

    def __init__(self, hook=lambda: None):
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.embed = nn.Parameter(torch.empty(5, 4))
        nn.init.trunc_normal_(self.embed, std=0.02)
        hook()
        self.register_buffer("noise", torch.randn(3, 3))
        self.register_buffer("row", self.noise[1])
        self.tail = nn.Parameter(torch.empty(6))
        nn.init.trunc_normal_(self.tail, std=1.0, a=-0.5, b=0.5)


class OwnGenModel(nn.Module):
    """Draws only from its own generator (seeded by ``seed``)."""

    def __init__(self, seed: int, hook=lambda: None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.empty(4, 6))
        nn.init.trunc_normal_(self.weight, std=0.5, generator=g)
        hook()
        self.bias = nn.Parameter(torch.empty(4).uniform_(-1, 1, generator=g))
        self.register_buffer("table", torch.rand(3, 2, generator=g))
        self.register_buffer("column", self.table[:, 1])


def _run_threads(*targets):
    """Run each target in its own thread; re-raise the first failure here."""
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported in the main thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 2)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]


def _eager_own(seed):
    return OwnGenModel(seed)


def test_deferral_beside_real_construction_and_materialization():
    torch.manual_seed(0)
    eager_a = DefaultGenModel()
    eager_b = [_eager_own(s) for s in (1, 2, 3)]
    to_materialize = [deferred_init(OwnGenModel, s) for s in (2, 3)]
    assert not _patched() and _modes() == (0, 0)

    inside = threading.Barrier(2, timeout=TIMEOUT)   # A is recording
    done = threading.Barrier(2, timeout=TIMEOUT)     # B has finished its checks
    results = {}

    def thread_a():
        def hook():
            # This thread records: its own modes are active.
            assert _modes()[0] >= 1 and _modes()[1] >= 1
            assert current_record() is not None and _patched()
            assert is_fake(torch.ones(1))
            inside.wait()
            done.wait()

        torch.manual_seed(0)
        m = deferred_init(DefaultGenModel, hook)
        assert is_deferred(m) and _modes() == (0, 0) and current_record() is None
        results["a"] = m

    def thread_b():
        inside.wait()
        try:
            # A records now; here nothing is fake and no mode is active.
            assert _modes() == (0, 0) and current_record() is None
            assert _patched(), "the trunc_normal_ diversion should be installed while A records"
            real = OwnGenModel(1)  # real trunc_normal_ goes through the diversion untouched
            assert not any(is_fake(t) for t in real.parameters())
            assert_same_tensors(eager_b[0], real)
            for m in to_materialize:
                materialize_module(m)
            results["b"] = real
        finally:
            done.wait()

    _run_threads(thread_a, thread_b)
    assert not _patched() and _modes() == (0, 0)
    materialize_module(results["a"])
    assert_same_tensors(eager_a, results["a"])
    for eager, m in zip(eager_b[1:], to_materialize):
        assert_same_tensors(eager, m)


def test_two_threads_deferring_share_the_patch():
    """The patch is reference counted: it stays while either thread records and
    goes when the last one leaves, whichever order they leave in."""
    torch.manual_seed(0)
    eager_a = DefaultGenModel()
    eager_b = _eager_own(7)
    step = [threading.Barrier(2, timeout=TIMEOUT) for _ in range(3)]
    results = {}

    def thread_a():
        def hook():
            step[0].wait()  # both are recording now
        torch.manual_seed(0)
        results["a"] = deferred_init(DefaultGenModel, hook)
        step[1].wait()  # A has left deferred_init; B is still inside
        step[2].wait()

    def thread_b():
        def hook():
            step[0].wait()
            step[1].wait()
            # A has left: the patch must still be there for B's trunc_normal_ below
            assert _patched() and patches.TRUNC_NORMAL.users >= 1
            step[2].wait()
        results["b"] = deferred_init(OwnGenModel, 7, hook)

    _run_threads(thread_a, thread_b)
    assert not _patched() and patches.TRUNC_NORMAL.users == 0
    materialize_module(results["a"])
    materialize_module(results["b"])
    assert_same_tensors(eager_a, results["a"])
    assert_same_tensors(eager_b, results["b"])


def test_patch_under_concurrent_churn():
    """Threads entering and leaving deferred_init in a loop while another thread
    keeps calling the real trunc_normal_: every real result is exact, every
    deferred one too, and the patch is gone at the end."""
    g = torch.Generator().manual_seed(5)
    expected = torch.empty(64)
    nn.init.trunc_normal_(expected, std=0.1, generator=g)
    references = {s: _eager_own(s) for s in range(4)}
    stop = threading.Event()
    failures = []

    def recorder(seeds):
        def run():
            try:
                for _ in range(15):
                    for s in seeds:
                        m = deferred_init(OwnGenModel, s)
                        materialize_module(m)
                        assert_same_tensors(references[s], m)
            finally:
                stop.set()
        return run

    def real_user():
        count = 0
        while not stop.is_set() or count < 20:
            t = torch.empty(64)
            nn.init.trunc_normal_(t, std=0.1, generator=torch.Generator().manual_seed(5))
            if not torch.equal(t, expected):
                failures.append(count)
            assert not is_fake(t) and _modes() == (0, 0)
            count += 1

    _run_threads(recorder([0, 1]), recorder([2, 3]), real_user)
    assert failures == []
    assert not _patched() and patches.TRUNC_NORMAL.users == 0


def test_error_in_one_thread_leaves_the_other_recording():
    """A constructor raising in one thread undoes only that thread's state."""
    step = [threading.Barrier(2, timeout=TIMEOUT) for _ in range(2)]
    results = {}
    eager = _eager_own(9)

    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))
            nn.init.trunc_normal_(self.w, generator=torch.Generator().manual_seed(0))
            step[0].wait()
            raise ValueError("boom")

    def thread_a():
        with pytest.raises(ValueError, match="boom"):
            deferred_init(Fails)
        assert _modes() == (0, 0) and current_record() is None
        step[1].wait()

    def thread_b():
        def hook():
            step[0].wait()
            step[1].wait()  # A has failed and cleaned up
            assert _patched() and current_record() is not None and _modes() != (0, 0)
        results["b"] = deferred_init(OwnGenModel, 9, hook)

    _run_threads(thread_a, thread_b)
    assert not _patched()
    materialize_module(results["b"])
    assert_same_tensors(eager, results["b"])
