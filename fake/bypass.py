"""Running ATen kernels directly: no modes, no subclass handlers, no torch functions.

The Fake layer computes on meta shadows and the interpreter replays on real
tensors; neither must be seen again by the modes that called them.

Example::

    >>> with fake_mode():
    ...     with no_python_dispatch():
    ...         t = torch.ones(2)
    >>> is_fake(t)
    False
"""

from __future__ import annotations

import torch


_K = torch._C.DispatchKey
# What torch._C._DisableTorchDispatch excludes.
_KEYS = tuple(getattr(_K, n) for n in ("Python", "PythonTLSSnapshot", "PreDispatch") if hasattr(_K, n))
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_exclude = torch._C._dispatch_tls_set_dispatch_key_excluded
_get_tf = torch._C._get_torch_function_state
_set_tf = torch._C._set_torch_function_state
_ALL_DISABLED = torch._C._TorchFunctionState.ALL_DISABLED


class no_python_dispatch:
    """Run ATen kernels directly: no modes, no subclass handlers, no torch functions.

    Set and put back with torch's thread-local setters, not its guard objects
    (``_DisableTorchDispatch``, ``DisableTorchFunction``): a guard an
    interrupt kept from exiting restores its saved state whenever the
    collector frees it, later, out of order with the guards after it, and
    leaves the thread's dispatch keys wrong for good.  What an interrupt
    leaves set here a public call's Entry puts back (deferinit.fake.guard).
    """

    __slots__ = ("_saved",)

    def __enter__(self):
        self._saved = (_get_tf(), tuple(_excluded(k) for k in _KEYS)); _set_tf(_ALL_DISABLED); [_exclude(k, True) for k in _KEYS]  # noqa: E501,E702

    def __exit__(self, *exc):
        tf, keys = self._saved; [_exclude(k, was) for k, was in zip(_KEYS, keys)]; _set_tf(tf)  # noqa: E702


_SUBCLASSES_DISABLED = torch._C._TorchFunctionState.SUBCLASSES_DISABLED
_ENABLED = torch._C._TorchFunctionState.ENABLED


class plain_queries:
    """Ask tensors' C methods and properties (``_is_view()``, ``grad_fn``...) without
    the lookup of a subclass's ``__torch_function__``: half their cost on a
    fake, whose handler is torch's disabled one anyway.  Only for loops
    over fakes and plain tensors (a user's subclass would not be asked);
    set and put back as :class:`no_python_dispatch` is.

    Example::

        >>> with plain_queries():
        ...     deferred_init(torch.nn.Linear, 2, 2).weight._is_view()
        False
    """

    __slots__ = ("_saved",)

    def __enter__(self):
        self._saved = saved = _get_tf(); _set_tf(_SUBCLASSES_DISABLED if saved == _ENABLED else saved)  # noqa: E702

    def __exit__(self, *exc):
        _set_tf(self._saved)
