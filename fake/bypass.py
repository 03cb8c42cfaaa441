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
