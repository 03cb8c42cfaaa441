"""Attributes of a module or class replaced while any thread needs them.

``deferinit`` diverts ``nn.init``'s ``trunc_normal_`` worker while it
records, and the Fake layer makes ``torch.Tensor._make_subclass`` accept
fakes (:mod:`deferinit.fake.subclass`): replacements shared by every thread that
records, installed by the first and removed by the last.
"""

from __future__ import annotations

import contextlib
import threading

_MISSING = object()


class SharedPatch:
    """Attributes of a module replaced while any thread holds the patch.

    Holding is reference counted under a lock: the first holder installs the
    replacements, the last one puts the originals back (deleting attributes
    the module did not have), whatever the threads and however they leave.
    ``replacements(module)`` returns ``{name: value}``; ``module`` is a
    callable returning the module, so that it is imported only when needed.

    Example::

        >>> import math
        >>> patch = SharedPatch(lambda: math, lambda m: {"tau": 6.0})
        >>> with patch.held():
        ...     math.tau
        6.0
        >>> math.tau
        6.283185307179586
    """

    def __init__(self, module, replacements):
        self._module = module
        self._replacements = replacements
        # Re-entrant: a release may come from a finalizer the cyclic collector
        # runs while this thread is inside acquire or release.
        self._lock = threading.RLock()
        self._saved: dict = {}
        self.users = 0

    def acquire(self) -> None:
        """Hold the patch (installing it if nobody held it); pair with :meth:`release`."""
        with self._lock:
            if self.users == 0:
                module = self._module()
                for name, value in self._replacements(module).items():
                    # A class's own attribute, not an inherited one: put back exactly.
                    own = isinstance(module, type)
                    self._saved[name] = vars(module).get(name, _MISSING) if own else getattr(module, name, _MISSING)
                    setattr(module, name, value)
            self.users += 1

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users == 0:
                module = self._module()
                for name, original in reversed(list(self._saved.items())):
                    if original is _MISSING:
                        delattr(module, name)
                    else:
                        setattr(module, name, original)
                self._saved.clear()

    @contextlib.contextmanager
    def held(self):
        self.acquire()
        try:
            yield
        finally:
            self.release()
