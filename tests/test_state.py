"""State restoration: after any error inside ``deferred_init`` or
``materialize_*``, global state is exactly as before.

What the toolkit changes while it works, and so must put back: the torch
function and dispatch mode stacks (recording), the ``trunc_normal_``
diversion (recording), the generators (recording marks their states;
replay sets them), the default dtype (replay runs each node under the
default dtype it was recorded with), grad and inference mode (replay runs
under ``no_grad`` or ``inference_mode``), and the per-thread record and
intended-device stacks.  Each test raises at a different point and compares
a full snapshot of that state, generator states byte for byte.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import deferinit.materialize.pipeline as pipeline
import deferinit.materialize.swap as swap_module
from deferinit import (
    DataDependentError,
    DeviceUnavailableError,
    ExternalTensorMutatedError,
    MaterializationError,
    ReplayError,
    deferred_init,
    is_deferred,
)
from deferinit import patches
from deferinit.session import current_record
from deferinit.fake import is_fake
from deferinit.fake.state import current_intended_device
from deferinit.fake.subclass import MAKE_SUBCLASS
from deferinit.materialize import materialize_module, materialize_tensor

EXPLICIT = torch.Generator().manual_seed(1234)


def snapshot():
    return {
        "function modes": list(_get_current_function_mode_stack()),
        "dispatch modes": list(_get_current_dispatch_mode_stack()),
        "trunc_normal_": nn.init._no_grad_trunc_normal_,
        "patch users": patches.TRUNC_NORMAL.users,
        "_make_subclass": vars(torch.Tensor).get("_make_subclass"),
        "_make_subclass users": MAKE_SUBCLASS.users,
        "default generator": bytes(torch.default_generator.get_state().numpy()),
        "explicit generator": bytes(EXPLICIT.get_state().numpy()),
        "default dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "record": current_record(),
        "intended device": current_intended_device(),
    }


def _key(value):
    # modes compare by identity
    return [id(m) for m in value] if isinstance(value, list) else value


def assert_restored(before):
    after = snapshot()
    changed = [k for k in before if _key(before[k]) != _key(after[k])]
    assert not changed, f"not restored: {changed}"


# -- errors inside deferred_init ----------------------------------------------


class Boom(Exception):
    pass


class Interrupt(BaseException):
    """Not an Exception: like KeyboardInterrupt, it must still clean up."""


def fails_after_draws(exc=Boom):
    def ctor():
        a = nn.Parameter(torch.empty(4, 4))
        nn.init.trunc_normal_(a, std=0.02)             # patched function, default generator
        torch.rand(3, generator=EXPLICIT)              # explicit generator marked
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        torch.ones(2)                                  # recorded under float64
        torch.set_default_dtype(previous)
        with torch.no_grad():
            torch.randn(2).normal_()
            raise exc("inside")
    return ctor


def fails_in_evaluate():
    # .item() replays the closure while recording, under float64 default
    # dtype, drawing random numbers first; the replayed op then fails.
    torch.set_default_dtype(torch.float64)
    try:
        t = torch.rand(3)
        t.index_fill_(0, torch.tensor([7]), 1.0)      # accepted by the meta kernel
        return t.sum().item()
    finally:
        torch.set_default_dtype(torch.float32)


def fails_in_nested():
    inner = deferred_init(nn.Linear, 3, 3)
    deferred_init(fails_after_draws())
    return inner


@pytest.mark.parametrize("ctor,exc", [
    (fails_after_draws(), Boom),
    (fails_after_draws(Interrupt), Interrupt),
    (fails_in_evaluate, ReplayError),
    (fails_in_nested, Boom),
], ids=["after-draws", "base-exception", "in-evaluate", "nested"])
def test_error_inside_deferred_init(ctor, exc):
    torch.manual_seed(3)
    torch.rand(1)  # a state that is not a fresh seed
    before = snapshot()
    with pytest.raises(exc):
        deferred_init(ctor)
    assert_restored(before)


def test_error_inside_deferred_init_under_modes_of_the_caller():
    """The caller's own state (no_grad, inference mode, float64) is kept too."""
    with torch.no_grad():
        torch.set_default_dtype(torch.float64)
        try:
            before = snapshot()
            with pytest.raises(Boom):
                deferred_init(fails_after_draws())
            assert_restored(before)
        finally:
            torch.set_default_dtype(torch.float32)
    with torch.inference_mode():
        before = snapshot()
        with pytest.raises(Boom):
            deferred_init(fails_after_draws())
        assert_restored(before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_data_dependent_error_inside_deferred_init():
    def ctor():
        w = torch.rand(2, device="cuda")
        return w.sum().item()

    before = snapshot()
    with pytest.raises(DataDependentError):
        deferred_init(ctor)
    assert_restored(before)


# -- errors inside materialize_* ----------------------------------------------


class Recorded(nn.Module):
    """Random nodes on both generators and under two default dtypes, then an
    op that fails only when replayed (an index out of range)."""

    def __init__(self, outside=None, bad=True):
        super().__init__()
        self.a = nn.Parameter(torch.empty(5, 5))
        nn.init.trunc_normal_(self.a)
        self.register_buffer("b", torch.rand(4, generator=EXPLICIT))
        torch.set_default_dtype(torch.float64)
        self.register_buffer("c", torch.randn(3))
        torch.set_default_dtype(torch.float32)
        if outside is not None:
            self.register_buffer("d", torch.randn(3) + outside)
        if bad:
            self.register_buffer("e", torch.zeros(2).index_fill_(0, torch.tensor([5]), 1.0))


def _deferred(*args, **kwargs):
    torch.manual_seed(0)
    m = deferred_init(Recorded, *args, **kwargs)
    torch.rand(2)
    EXPLICIT.manual_seed(77)  # generators moved on since recording
    return m


def _fakes(m):
    return {n: t for n, t in list(m.named_parameters()) + list(m.named_buffers())}


@pytest.mark.parametrize("how", ["module", "inference", "tensor", "device"])
def test_replay_error(how):
    m = _deferred()
    fakes = _fakes(m)
    before = snapshot()
    with pytest.raises(ReplayError):
        if how == "module":
            materialize_module(m)
        elif how == "inference":
            materialize_module(m, inference=True)
        elif how == "device":
            materialize_module(m, device="cpu")
        else:
            materialize_tensor(m.e)
    assert_restored(before)
    assert _fakes(m) == fakes and all(is_fake(t) for t in fakes.values())


def test_external_tensor_mutated_error():
    outside = torch.ones(3)
    m = _deferred(outside, bad=False)
    outside.mul_(2)
    before = snapshot()
    with pytest.raises(ExternalTensorMutatedError):
        materialize_module(m)
    assert_restored(before)
    assert is_deferred(m.d)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_device_unavailable_error():
    m = _deferred(bad=False)
    before = snapshot()
    with pytest.raises(DeviceUnavailableError):
        materialize_module(m, device="cuda")
    assert_restored(before)
    assert is_deferred(m)


def test_swap_error(monkeypatch):
    """A failure while swapping the real tensors in undoes the swaps made so far."""
    m = _deferred(bad=False)
    fakes = _fakes(m)
    calls = []
    real_exchange = swap_module.exchange

    def flaky(t1, t2):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("swap failed")
        real_exchange(t1, t2)

    monkeypatch.setattr(swap_module, "exchange", flaky)  # what Swaps and swap() exchange contents with
    before = snapshot()
    with pytest.raises(MaterializationError, match="nothing was changed"):
        materialize_module(m)
    assert_restored(before)
    assert len(calls) == 3  # the third failed; Swaps.undo put back the two before (checked next)
    assert _fakes(m) == fakes and all(is_fake(t) and is_deferred(t) for t in fakes.values())
    monkeypatch.undo()
    materialize_module(m)  # and it can still be materialized
    assert not is_deferred(m)


def test_check_fn_error():
    m = _deferred(bad=False)

    def check_fn(module):
        raise Boom("check_fn")

    before = snapshot()
    with pytest.raises(Boom):
        materialize_module(m, check_fn=check_fn)
    assert_restored(before)
    assert is_deferred(m)


def test_progress_callback_error(monkeypatch):
    """An exception from the progress bar mid-replay (a user's Ctrl-C, say)."""
    m = _deferred(bad=False)

    class Shown:
        def replay_callback(self, replay, fakes):
            def callback(done, total):
                if done == 3:
                    raise Interrupt()

            return callback

        def close(self, ok=True):
            pass

    monkeypatch.setattr(pipeline, "start_progress", lambda progress, fakes: Shown())
    before = snapshot()
    with pytest.raises(Interrupt):
        materialize_module(m)
    assert_restored(before)
    assert is_deferred(m)


def test_snapshot_notices_changes():
    """The comparison is able to fail, for each kind of state."""
    before = snapshot()
    changes = [
        lambda: torch.rand(1),
        lambda: torch.rand(1, generator=EXPLICIT),
    ]
    for change in changes:
        change()
        with pytest.raises(AssertionError):
            assert_restored(before)
        before = snapshot()
    with torch.no_grad():
        with pytest.raises(AssertionError, match="grad"):
            assert_restored(before)
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(AssertionError, match="default dtype"):
            assert_restored(before)
    finally:
        torch.set_default_dtype(torch.float32)
    with patches.TRUNC_NORMAL.held():
        with pytest.raises(AssertionError, match="trunc_normal_"):
            assert_restored(before)
    with MAKE_SUBCLASS.held():
        with pytest.raises(AssertionError, match="_make_subclass"):
            assert_restored(before)
