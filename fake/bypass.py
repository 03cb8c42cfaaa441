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


class no_python_dispatch:
    """Run ATen kernels directly: no modes, no subclass handlers, no torch functions."""

    __slots__ = ("_a", "_b")

    # One line each: no line of their own between the two guards, where an
    # interrupt would leave one entered (fake/locking.py says why); what a
    # signal between the two C calls leaves, a public call's Entry puts back.
    def __enter__(self):
        self._a, self._b = torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction(); self._a.__enter__(); self._b.__enter__()  # noqa: E501,E702

    def __exit__(self, *exc):
        self._b.__exit__(*exc); self._a.__exit__(*exc)  # noqa: E702
