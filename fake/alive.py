"""What the fakes alive hold: torch.Tensor's ``.data`` and ``set_`` patches, from the first fake to the last.

``real.data = fake`` and ``real.set_(fake)`` need :mod:`deferinit.fake.assign`'s
versions of ``torch.Tensor.data`` and ``torch.Tensor.set_`` for as long as a
fake exists that could be assigned (see :mod:`deferinit.fake.replaced`).  Every
fake holds a :class:`Life` token (in its ``__dict__``); the token holds the
patch, and when the last fake holding it dies (materialized: the fake's
contents go to an object that dies with the swap; or collected), the token
dies and gives the patch back: a process that imports the packages and
never makes a fake, or whose fakes are all gone, runs PyTorch's own
functions at PyTorch's own speed.
"""

from __future__ import annotations

import threading
import weakref

from .locking import locked
from .patch import release_all


#: The patches every live fake holds (fake/assign.py adds torch.Tensor's .data and set_).
HELD: list = []


def hold_while_fakes_live(patch) -> None:
    """Hold ``patch`` from the first fake made to the last one gone (tokens made from now on).

    Example::

        >>> from deferinit.fake.assign import TENSOR_DATA
        >>> TENSOR_DATA in HELD
        True
    """
    HELD.append(patch)


class Life:
    """The token every fake made since the last one died holds."""

    __slots__ = ("__weakref__",)


_lock = threading.Lock()
_current = None  # weakref.ref to the current Life, or None


def life() -> Life:
    """The token a new fake holds (a new one, holding the patch, when the last died).

    Example::

        >>> from deferinit.fake import fake_mode
        >>> with fake_mode():
        ...     f = torch.ones(2)
        >>> from deferinit.fake.assign import TENSOR_DATA
        >>> f.__dict__["_life"] is life(), TENSOR_DATA.installed()
        (True, True)
    """
    ref = _current
    token = ref() if ref is not None else None
    return token if token is not None else _new()


def _new() -> Life:
    return locked(_lock, _made)


def _made() -> Life:
    global _current
    token = _current() if _current is not None else None
    if token is not None:
        return token
    token = Life()
    # The holder is a name of its own (the token cannot hold itself),
    # released when the token dies; a release before the hold is a no-op.
    holder = object()
    weakref.finalize(token, release_all, HELD, holder)  # release_all: safe in a finalizer
    for patch in HELD:
        patch.acquire(holder)
    _current = weakref.ref(token)
    return token

