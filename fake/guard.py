"""All or nothing for the calling thread: an interrupted public call leaves torch as it found it.

A ``KeyboardInterrupt``, a ``SystemExit`` or a signal handler's exception
may arrive at any line, also inside the project's own ``__enter__`` and
``__exit__`` (docs/design.md, "Interrupts").  So each public call notes at
its start what it may change in the calling thread, an :class:`Entry` (the
torch-function and dispatch mode stacks and the flags beside them, grad
mode, the default dtype, the per-thread stacks the layers
:func:`register`, every :class:`~deferinit.fake.patch.SharedPatch` it
holds), and on any ``BaseException`` puts it back, idempotently, reading
the state rather than trusting what was recorded of it.

Exits that must run although the interrupt may arrive in them are written
``try: leave()`` / ``finally: leave()`` with each clause on one line (and
``leave`` idempotent): the compiler then puts no instruction of its own
before the protected call, so one interrupt anywhere, even inside the first
``leave()``, leaves the second to finish.  For the same reason
:func:`undoing` nests two handlers, each on one line (a second interrupt
at a handler's start skips it), and the project's context managers are
classes, never ``contextlib`` generators (a generator an interrupt left
suspended runs its undo whenever the collector closes it).
"""

from __future__ import annotations

import gc

import torch
import torch.utils._python_dispatch as _pd

from .patch import all_patches

_len_function = torch._C._len_torch_function_stack
_function_at = torch._C._get_function_stack_at
_push_function = torch._C._push_on_torch_function_stack
_pop_function = torch._C._pop_torch_function_stack
_len_dispatch = torch._C._len_torch_dispatch_stack
_dispatch_at = torch._C._get_dispatch_stack_at
_push_dispatch = torch._C._push_on_torch_dispatch_stack
_pop_dispatch = torch._C._pop_torch_dispatch_stack

# PyTorch's process-wide notes of dispatch modes entered (TorchDispatchMode.__enter__).
_DISPATCH_FLAGS = (
    "_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
    "_is_in_any_mode_without_ignore_compile_internals",
)

#: (save, restore) pairs of the per-thread state layers keep: ``save()`` returns
#: what ``restore(saved)`` puts back.
_REGISTERED: list = []


def register(save, restore) -> None:
    """Have every :class:`Entry` note ``save()`` and put it back with ``restore``.

    Example::

        >>> stack = []
        >>> register(lambda: len(stack), lambda n: stack.__delitem__(slice(n, None)))
        >>> entry = Entry(); stack.append(1); entry.restore(); stack
        []
    """
    _REGISTERED.append((save, restore))


_included = torch._C._dispatch_tls_local_include_set
_excluded = torch._C._dispatch_tls_local_exclude_set
_torch_function_state = torch._C._get_torch_function_state
_set_torch_function_state = torch._C._set_torch_function_state
# The keys no_python_dispatch's _DisableTorchDispatch excludes; only these are
# put back (the others belong to C++ guards of the frames below, which restore
# their own on the way out).
_K = torch._C.DispatchKey
_KEYS = tuple(getattr(_K, n) for n in ("Python", "PythonTLSSnapshot", "PreDispatch") if hasattr(_K, n))


def _put_keys_back(included, excluded) -> None:
    """Make the thread's local dispatch keys of :data:`_KEYS` ``included`` and ``excluded`` again."""
    for now, wanted, set_ in (
        (_included(), included, torch._C._dispatch_tls_set_dispatch_key_included),
        (_excluded(), excluded, torch._C._dispatch_tls_set_dispatch_key_excluded),
    ):
        if now.raw_repr() == wanted.raw_repr():
            continue
        for key in _KEYS:
            has = wanted.has(key)
            if now.has(key) != has:
                set_(key, has)


def _stack(length, at) -> list:
    return [at(i) for i in range(length())]


class Entry:
    """What the calling thread had when a public call started; :meth:`restore` puts
    it back.  The entry is also the name under which the call holds patches.

    Example::

        >>> entry = Entry()
        >>> torch._C._set_grad_enabled(False)
        >>> entry.restore(); torch.is_grad_enabled()
        True
    """

    __slots__ = ("functions", "dispatch", "flags", "grad", "dtype", "keys", "tf_state", "saved", "collecting", "__weakref__")

    #: Classes whose instances on a mode stack are the project's (set by fake/mode.py).
    OURS: tuple = ()

    def __init__(self):
        self.functions = _stack(_len_function, _function_at)
        self.dispatch = _stack(_len_dispatch, _dispatch_at)
        self.flags = tuple(getattr(_pd, name, None) for name in _DISPATCH_FLAGS)
        self.grad = torch.is_grad_enabled()
        self.dtype = torch.get_default_dtype()
        self.keys = (_included(), _excluded())
        self.tf_state = _torch_function_state()
        self.saved = [save() for save, _ in _REGISTERED]
        self.collecting = gc.isenabled()  # a materialization pauses the collector

    def restore(self) -> None:
        """Put the thread back as it was at the entry (idempotent): what a call that
        failed or was interrupted leaves."""
        self._put_back(full=True)

    def leave(self) -> None:
        """What a block leaves when it ends (idempotent): the project's own modes,
        thread stacks and patch holds as at the entry, and what the user's code
        in the block changed (a mode it pushed, the default dtype) as it is."""
        self._put_back(full=False)

    def _put_back(self, full: bool) -> None:
        ours = Entry.OURS
        for wanted, length, at, pop, push in (
            (self.functions, _len_function, _function_at, _pop_function, _push_function),
            (self.dispatch, _len_dispatch, _dispatch_at, lambda: _pop_dispatch(None), _push_dispatch),
        ):
            if not full:
                # The user's own modes pushed meanwhile stay, above the entry's.
                known = {id(m) for m in wanted}
                wanted = wanted + [m for m in _stack(length, at) if id(m) not in known and not isinstance(m, ours)]
            _rebuild(wanted, length, at, pop, push)
        # First: a registered stack may hold C++ guards (deferinit.fake.gradmode's
        # inference-mode guard), whose release puts back grad mode and dispatch
        # keys as they were at the guard's entry, before the checks below.
        for (_, restore), saved in zip(_REGISTERED, self.saved):
            restore(saved)
        if full:
            # TorchDispatchMode's enter and exit keep these beside the stack; an
            # interrupt between the two halves of either leaves them wrong.
            if any(getattr(_pd, n, None) is not v for n, v in zip(_DISPATCH_FLAGS, self.flags) if v is not None):
                for name, value in zip(_DISPATCH_FLAGS, self.flags):
                    if value is not None:
                        setattr(_pd, name, value)
                mirror = getattr(_pd, "set_is_in_mode_without_ignore_compile_internals", None)
                if mirror is not None and self.flags[2] is not None:
                    mirror(self.flags[2])
            if torch.is_grad_enabled() != self.grad:
                torch._C._set_grad_enabled(self.grad)
            if torch.get_default_dtype() != self.dtype:
                torch.set_default_dtype(self.dtype)
            # What C++ guards entered and never exited leave (no_python_dispatch's
            # _DisableTorchDispatch and DisableTorchFunction, interrupted between
            # their enter and exit).
            if _torch_function_state() != self.tf_state:
                _set_torch_function_state(self.tf_state)
            _put_keys_back(*self.keys)
            if self.collecting and not gc.isenabled():
                gc.enable()
        for patch in all_patches():
            patch.release(self)
            patch.settle()


def _rebuild(wanted: list, length, at, pop, push) -> bool:
    """Make a mode stack ``wanted`` again: pop down to the part both share, push the
    rest of ``wanted``.  Returns whether it had to."""
    now = _stack(length, at)
    if len(now) == len(wanted) and all(a is b for a, b in zip(now, wanted)):
        return False
    common = 0
    while common < min(len(now), len(wanted)) and now[common] is wanted[common]:
        common += 1
    for _ in range(len(now) - common):
        pop()
    for mode in wanted[common:]:
        push(mode)
    return True


def undoing(undo, fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)``; on any ``BaseException``, ``undo()`` (idempotent) runs
    before the exception goes on, also when a second interrupt arrives at the
    start of the first undo or inside it (two handlers, each on one line: the
    second finishes what the first did not).

    Example::

        >>> done = []
        >>> def work():
        ...     done.append(1)
        ...     raise KeyboardInterrupt
        >>> try:
        ...     undoing(done.clear, work)
        ... except KeyboardInterrupt:
        ...     done
        []
    """
    try:
        try: return fn(*args, **kwargs)  # noqa: E701 - one line each: see the module's docstring
        except BaseException: undo(); raise  # noqa: E701,E702
    except BaseException: undo(); raise  # noqa: E701,E702


def restoring(entry: Entry, fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` as a public call begun at ``entry``: on any
    ``BaseException`` the thread is put back as it was then (:func:`undoing`).

    Example::

        >>> def interrupted():
        ...     torch._C._set_grad_enabled(False)
        ...     raise KeyboardInterrupt
        >>> try:
        ...     restoring(Entry(), interrupted)
        ... except KeyboardInterrupt:
        ...     torch.is_grad_enabled()
        True
    """
    return undoing(entry.restore, fn, *args, **kwargs)
