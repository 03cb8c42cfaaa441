"""``deferred_init`` and ``with deferred():``: every tensor made inside is fake and recorded."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from deferinit.fake.guard import Entry
from deferinit.fake.mode import fake_modes

from . import patches, pending, seeding
from .holdings import module_tensors
from .record import Record, current_record, open_records
from .recorder import RECORDER, is_deferred_fake


def deferred_init(module_fn, *args, **kwargs):
    """Call ``module_fn(*args, **kwargs)`` with every tensor fake and its recipe recorded.

    Returns what ``module_fn`` returns.  No parameter or buffer memory is
    allocated; every tensor made inside is a fake that reports the device it
    was asked for (``cuda`` works without CUDA) and remembers how it was
    computed, so :func:`deferinit.materialize.materialize_module` can later produce
    exactly the values eager construction would have.  The default random
    generator is not advanced.  Nested calls share one record; the recording
    is per thread; on an exception everything entered is left again and the
    exception propagates with a note naming the constructor.  :func:`deferred`
    is the same as a ``with`` block.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 4096, 4096, device="cuda")
        >>> m.weight
        Parameter containing:
        tensor(..., size=(4096, 4096), device='cuda:0', requires_grad=True, fake=True)
        >>> is_deferred(m)
        True
    """
    if not callable(module_fn):
        raise TypeError(f"deferred_init() expects a callable, got {type(module_fn).__name__}")
    label = _label(module_fn)
    with _recording(label, f"deferred_init({label})"):
        return module_fn(*args, **kwargs)


def deferred():
    """Context manager: every tensor made in the block is deferred and recorded.

    The ``with`` form of :func:`deferred_init`, for code that reads better
    as a block (``AutoModel.from_config``, factory functions, notebooks):
    inside the block everything is recorded exactly as inside a
    ``deferred_init`` call; the modules made there stay deferred after it.
    Blocks nest with each other and with ``deferred_init`` (one record);
    recording is per thread; an exception leaves every mode, patch and
    generator as it was and propagates with a note naming the block.

    Example::

        >>> from deferinit import deferred
        >>> with deferred():
        ...     m = torch.nn.Sequential(torch.nn.Linear(4096, 4096, device="cuda"), torch.nn.ReLU())
        >>> is_deferred(m), m[0].weight.device
        (True, device(type='cuda', index=0))
    """
    # Where the block is, for its label in messages and graphs only (nothing
    # behaves differently by it): a context manager is not told its caller.
    caller = sys._getframe(1)
    where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
    return _recording(f"deferred() at {where}", f"with deferred() at {where}")


@contextlib.contextmanager
def _recording(label: str, note: str):
    """Record everything made in the block: the outermost block opens a record
    and closes it on exit; nested blocks (either form) share it.

    All or nothing for the thread whatever ends the block, wherever an
    interrupt arrives: the entry (:class:`~deferinit.fake.guard.Entry`) holds
    the block's patches and puts back the thread's modes and record stack;
    closing the record (which gives explicit generators their real states
    back) is idempotent, and run by an exit an interrupt cannot skip."""
    entry = Entry()
    outer = current_record()
    record = outer if outer is not None else Record(label)
    try:
        open_records().append(record)
        patches.TRUNC_NORMAL.acquire(entry)
        seeding.hold(entry)
        with fake_modes(RECORDER, record, fake_cuda=True):
            yield record
    except BaseException as e:
        entry.restore()
        if outer is None and isinstance(e, Exception) and hasattr(e, "add_note"):
            e.add_note(f"(raised inside {note})")
        raise
    finally:
        try: _leave(entry, record, outer)  # noqa: E701 - one line each: see deferinit.fake.guard
        finally: _leave(entry, record, outer)  # noqa: E701


def _leave(entry, record, outer) -> None:
    """End a recording block (idempotent): the thread's record stack and patches
    as at its entry, and the outermost block's record closed and watched."""
    entry.leave()
    if outer is None:
        record.close()
        if record.chained:
            seeding.hold_while_alive(record)
        pending.watch(record)


def _label(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def is_deferred(obj) -> bool:
    """Whether ``obj`` still has recorded tensors to materialize.

    For a tensor: it is a fake whose recipe was recorded by
    :func:`deferred_init` (a DTensor whose local shard is such a fake counts).
    For a module: any tensor it or its submodules hold is (parameters,
    buffers, plain attributes and the tensors in lists, tuples and dicts
    they hold; see :func:`deferinit.holdings.holdings`).
    Anything else raises ``ValueError``.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 2, 3)
        >>> is_deferred(m), is_deferred(m.weight), is_deferred(torch.ones(1))
        (True, True, False)
    """
    if isinstance(obj, torch.Tensor):
        return is_deferred_fake(obj) or is_deferred_fake(getattr(obj, "_local_tensor", None))
    if isinstance(obj, torch.nn.Module):
        return any(is_deferred(t) for t in _tensors(obj))
    raise ValueError(
        f"is_deferred() expects a tensor or an nn.Module, got {type(obj).__name__}"
    )


def _tensors(module: torch.nn.Module):
    for _, t, _, _ in module_tensors(module):
        yield t
