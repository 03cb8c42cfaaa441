"""``deferred_init`` and ``with deferred():``: every tensor made inside is fake and recorded."""

from __future__ import annotations

import os
import sys

import torch

from deferinit.fake.guard import Entry, undoing
from deferinit.fake.mode import fake_modes

from . import patches
from .random import pending, seeding
from .errors import UnsupportedModeError
from .holdings import module_tensors
from .random.record import Record, current_record, open_records
from .recorder import RECORDER, is_deferred_fake
from .wrappers import deferred_inside


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
    recording = _Recording(label, f"deferred_init({label})")
    recording.__enter__()
    # Not a ``with``: Python reports a line at the start of its exception
    # handler, and a second interrupt there would skip ``__exit__``.  Three
    # exits, each on one line and no bare ``try:`` line (Python reports a
    # line there too, outside the block): wherever two interrupts arrive,
    # one exit finishes (see deferinit.fake.guard).
    try: result = module_fn(*args, **kwargs); recording.ok = True  # noqa: E701,E702
    finally:
        try: recording.end(not recording.ok)  # noqa: E701
        finally:
            try: recording.end(True)  # noqa: E701
            finally: recording.end(True)  # noqa: E701
    return result


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
    return _Recording(f"deferred() at {where}", f"with deferred() at {where}")


class _Recording:
    """Record everything made in the block: the outermost block opens a record
    and closes it on exit; nested blocks (either form) share it.

    All or nothing for the thread whatever ends the block, wherever an
    interrupt arrives: the entry (:class:`~deferinit.fake.guard.Entry`) holds
    the block's patches and puts back the thread's modes and record stack;
    closing the record (which gives explicit generators their real states
    back) is idempotent.  A class, not a ``contextlib`` generator: an
    interrupt keeping a generator's ``__exit__`` from running left it
    suspended, and the collector closed it, running this undo, inside some
    later, unrelated deferral (see :mod:`deferinit.fake.guard`)."""

    __slots__ = ("label", "note", "entry", "outer", "record", "modes", "ok", "done")

    def __init__(self, label: str, note: str) -> None:
        self.label, self.note = label, note
        self.entry = self.outer = self.record = self.modes = None
        self.ok = False  # the body returned (deferred_init)
        self.done = False

    def __enter__(self):
        _refuse_unhonourable_modes(self.note)
        self.entry = Entry()
        self.outer = current_record()
        # One line: an interrupt at a later line of __enter__ would leave the
        # block's modes pushed, and the with statement calls no __exit__ then.
        return undoing(lambda: self.end(True), self._open)

    def _open(self) -> Record:
        patches.TRUNC_NORMAL.acquire(self.entry)
        seeding.hold(self.entry)
        # The record reads the generators' entry states once the seeding API
        # is diverted and no call that missed the diversion is under way: a
        # seed another thread sets from then on is logged (record.FOREIGN),
        # not taken for this thread's own at its first draw.
        if self.outer is None:
            seeding.wait_for_undiverted_calls()
        self.record = self.outer if self.outer is not None else Record(self.label)
        open_records().append(self.record)
        self.modes = fake_modes(RECORDER, self.record, fake_cuda=True)
        self.modes.__enter__()
        return self.record

    def __exit__(self, kind, value, tb) -> None:
        # No bare ``try:`` line first: Python reports a line there, outside the block.
        try: self.end(kind is not None)  # noqa: E701 - one line each: see deferinit.fake.guard
        finally:
            try: self.end(True)  # noqa: E701
            finally: self.end(True)  # noqa: E701

    def end(self, failed: bool) -> None:
        """Leave the block (idempotent): as it ended, or, ``failed``, with the
        thread put back as at its entry; the outermost block's record closed."""
        if self.done or self.entry is None:
            return
        if self.modes is not None:
            self.modes.exit(failed)
        if failed:
            self.entry.restore()
            e = sys.exc_info()[1]
            noted = f"(raised inside {self.note})"
            if self.outer is None and isinstance(e, Exception) and noted not in getattr(e, "__notes__", ()):
                e.add_note(noted)
        _leave(self.entry, self.record, self.outer, failed)
        self.done = True


def _leave(entry, record, outer, failed: bool) -> None:
    """End a recording block (idempotent): the thread's record stack and patches
    as at its entry, and the outermost block's record closed and watched; or,
    ``failed``, abandoned (:meth:`~deferinit.random.record.Record.abandon`)."""
    entry.leave()
    if outer is None and record is not None:  # None: interrupted before it was made
        if failed:
            record.abandon()
        record.close()
        if record.abandoned:
            return
        if record.chained:
            seeding.hold_while_alive(record)
        pending.watch(record)


def _refuse_unhonourable_modes(note: str) -> None:
    """Refuse to enter under a dispatch mode the deferral cannot honour.

    User modes, entered outside the block or inside it, see every call the
    block makes and what they return is recorded (the block's own modes sit
    below them, ``deferinit.fake.mode``).  PyTorch's infrastructure modes
    (``is_infra_mode()``: FakeTensorMode, make_fx's proxy mode,
    functionalization) sit below every other mode and make the tensors
    themselves: under them eager construction gives their tensors and their
    graph, which a deferral, making its own fakes, cannot.
    """
    for i in range(torch._C._len_torch_dispatch_stack()):
        mode = torch._C._get_dispatch_stack_at(i)
        if mode.is_infra_mode():
            name = f"{type(mode).__module__}.{type(mode).__qualname__}"
            raise UnsupportedModeError(
                f"{note} cannot be entered under {type(mode).__name__} ({name}): PyTorch's "
                "tracing and fake-tensor modes make every tensor themselves, so eagerly this "
                f"block would give {type(mode).__name__}'s tensors (and its trace), which a deferral "
                "cannot record. Enter the deferral outside that mode, or build the module there "
                "without deferral (materialize a deferred module first, then run it under the mode)."
            )


def _label(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def is_deferred(obj) -> bool:
    """Whether ``obj`` still has recorded tensors to materialize.

    For a tensor: it is a fake whose recipe was recorded by
    :func:`deferred_init`, or a wrapper subclass with such a fake inside (a
    DTensor's local shard, a quantized tensor's data; see
    :mod:`deferinit.wrappers`).
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
        return is_deferred_fake(obj) or deferred_inside(obj)
    if isinstance(obj, torch.nn.Module):
        return any(is_deferred(t) for _, t, _, _ in module_tensors(obj))
    raise ValueError(
        f"is_deferred() expects a tensor or an nn.Module, got {type(obj).__name__}"
    )
