"""Attributes of a module or class replaced while anyone holds them, put back when nobody does.

Every replacement the project makes is listed in :mod:`deferinit.fake.replaced`
and installed through a :class:`SharedPatch`: ``.data`` and ``set_`` while a
fake is alive (:mod:`deferinit.fake.alive`), ``_make_subclass`` while a thread
is in a fake mode (:mod:`deferinit.fake.subclass`), ``nn.init``'s
``trunc_normal_`` worker and the generator API while a thread records
(``deferinit.patches``, ``deferinit.random.seeding``), and so on.
"""

from __future__ import annotations

import threading

from .locking import locked
from .replaced import entry

_MISSING = object()


class SharedPatch:
    """Attributes of a module replaced while anyone holds the patch.

    Holders are named (any hashable object: a record, a token), so that
    taking and giving back are idempotent: whether the replacements are in
    place follows from whether anyone holds them, and :meth:`settle` makes
    it so.  That is what keeps an interrupt (``KeyboardInterrupt`` between
    two ``setattr``) from leaving half a patch: the next settle finishes the
    job, and every public call settles the patches on its way out
    (``deferinit.fake.guard``).  The originals are put back only where the
    attribute is still ours: a replacement another library made on top of
    ours meanwhile is left to it.  ``key`` names the entry of
    :data:`deferinit.fake.replaced.TABLE` that lists these attributes;
    ``replacements(module)`` returns ``{name: value}`` (made once);
    ``module`` is a callable returning the module, imported only when needed.

    Example::

        >>> import math
        >>> patch = SharedPatch("trunc normal", "torch.nn.init", lambda: math,
        ...                     lambda m: {"_no_grad_trunc_normal_": 6.0})
        >>> with patch.held():
        ...     math._no_grad_trunc_normal_
        6.0
        >>> hasattr(math, "_no_grad_trunc_normal_")
        False
    """

    def __init__(self, key: str, owner: str, module, replacements):
        self.key = key
        self.owner = owner
        self._module = module
        self._replacements = replacements
        # Re-entrant: a release may come from a finalizer the cyclic collector
        # runs while this thread is inside acquire or release.
        self._lock = threading.RLock()
        self._holders: set = set()
        self._made: dict | None = None
        self._made_from: dict = {}
        self._saved: dict = {}
        # Whether the last settle completed with the replacements in place.
        self._installed = False

    @property
    def users(self) -> int:
        """How many hold the patch now."""
        return len(self._holders)

    def acquire(self, holder=None):
        """Hold the patch as ``holder`` (a new token if None); returns the holder, to
        give to :meth:`release`.  Holding twice under one name holds once."""
        holder = object() if holder is None else holder
        locked(self._lock, self._change, self._holders.add, holder)
        return holder

    def release(self, holder) -> None:
        """Stop holding as ``holder`` (nothing if it does not hold)."""
        locked(self._lock, self._change, self._holders.discard, holder)

    def _change(self, change, holder) -> None:
        # Settled whatever line an interrupt arrives at (a finalizer's release,
        # whose interrupt Python swallows, included): see deferinit.fake.guard.
        # Three settles: two interrupts (a finalizer's swallowed one and the next) leave a third.
        try: change(holder); self._settle()  # noqa: E701,E702
        finally:
            try: self._settle()  # noqa: E701
            finally: self._settle()  # noqa: E701

    def settle(self) -> None:
        """Put the replacements in place if anyone holds them, the originals back if
        nobody does; finishes what an interrupted call left half done."""
        locked(self._lock, self._settle)

    def _settle(self) -> None:
        if self._holders:
            if not self._installed:
                self._install()
                self._installed = True
        elif self._installed or self._saved:
            self._uninstall()
            self._installed = False

    def _install(self) -> None:
        module = self._module()
        own = isinstance(module, type)  # a class's own attribute, not an inherited one
        if self._made is None or self._moved(module, own):
            # Made again when what is there changed since (a library wrapped it):
            # the replacements wrap what is there now, not what was.
            self._made_from = {}
            made = self._replacements(module)
            entry(self.key, self.owner, made)
            self._made_from = {name: _value(module, name, own) for name in made}
            self._made = made
        for name, value in self._made.items():
            current = _value(module, name, own)
            if current is value:
                continue
            self._saved.setdefault(name, current)
            setattr(module, name, value)

    def _moved(self, module, own: bool) -> bool:
        made = self._made
        return any(
            (current := _value(module, name, own)) is not was and current is not made[name]
            for name, was in self._made_from.items()
        )

    def _uninstall(self) -> None:
        module = self._module()
        own = isinstance(module, type)
        for name, original in reversed(list(self._saved.items())):
            current = _value(module, name, own)
            ours = self._made.get(name) if self._made is not None else None
            if ours is not None and current is ours:
                if original is _MISSING:
                    delattr(module, name)
                else:
                    setattr(module, name, original)
            elif ours is not None and original is not _MISSING:
                _rewrap(current, ours, original)
            del self._saved[name]

    def originals(self) -> dict:
        """``{name: what it was}`` for the attributes replaced now (empty when none is).

        Example::

            >>> import types
            >>> init = types.ModuleType("init")
            >>> init._no_grad_trunc_normal_ = 1.0
            >>> patch = SharedPatch("trunc normal", "torch.nn.init", lambda: init,
            ...                     lambda m: {"_no_grad_trunc_normal_": 6.0})
            >>> with patch.held():
            ...     patch.originals()
            {'_no_grad_trunc_normal_': 1.0}
        """
        return dict(self._saved)

    def installed(self) -> bool:
        """Whether the replacements are in place now (every one of them).

        Example::

            >>> import math
            >>> patch = SharedPatch("trunc normal", "torch.nn.init", lambda: math,
            ...                     lambda m: {"_no_grad_trunc_normal_": 6.0})
            >>> patch.installed()
            False
        """
        made = self._made
        if made is None:
            return False
        module = self._module()
        own = isinstance(module, type)
        return all((vars(module).get(n) if own else getattr(module, n, None)) is v for n, v in made.items())

    def held(self) -> "Held":
        """A context manager holding the patch for its block (see :class:`Held`)."""
        return Held(self)


class Held:
    """Holds a :class:`SharedPatch` for a block; a class, not a generator (see
    :mod:`deferinit.fake.guard`): its exit releases in one step, twice over, so
    a second interrupt arriving in the first release leaves the second."""

    __slots__ = ("patch", "holder")

    def __init__(self, patch: SharedPatch) -> None:
        self.patch, self.holder = patch, object()

    def __enter__(self) -> None:
        self.patch.acquire(self.holder)  # settled and released by the exit, however interrupted

    def __exit__(self, *exc) -> None:
        try: self.patch.release(self.holder)  # noqa: E701 - one line each: see deferinit.fake.guard
        finally: self.patch.release(self.holder)  # noqa: E701


def release_all(patches, holder) -> None:
    """Stop holding each of ``patches`` as ``holder``, the last first, also when an
    interrupt arrives in it.  What the finalizers run when a holder's owner
    dies: Python swallows an exception raised in a finalizer, so nothing
    else would finish a release an interrupt stopped half way, and the
    patches not reached yet would stay held for good.  Three passes, each on
    one line (see :mod:`deferinit.fake.guard`); a release is idempotent.

    Example::

        >>> import math
        >>> patch = SharedPatch("trunc normal", "torch.nn.init", lambda: math,
        ...                     lambda m: {"_no_grad_trunc_normal_": 6.0})
        >>> holder = patch.acquire()
        >>> release_all([patch], holder)
        >>> patch.users, hasattr(math, "_no_grad_trunc_normal_")
        (0, False)
    """
    try: _release_each(patches, holder)  # noqa: E701 - one line each: see deferinit.fake.guard
    finally:
        try: _release_each(patches, holder)  # noqa: E701
        finally: _release_each(patches, holder)  # noqa: E701


def _release_each(patches, holder) -> None:
    for patch in reversed(patches):
        patch.release(holder)


#: Every SharedPatch made, for :func:`all_patches`.
_ALL: list = []
_made_lock = threading.Lock()


def _value(module, name: str, own: bool):
    return vars(module).get(name, _MISSING) if own else getattr(module, name, _MISSING)


def _rewrap(current, ours, original) -> None:
    """A wrapper another library made of ours while it was in place (``functools.wraps``
    over a closure: torch._dynamo's import wraps ``torch.manual_seed``) wraps the
    original once ours is gone, as it would have without us; any other is left as is."""
    if getattr(current, "__wrapped__", None) is not ours:
        return
    cells = [c for c in getattr(current, "__closure__", None) or () if _holds(c, ours)]
    if not cells:
        return
    for cell in cells:
        cell.cell_contents = original
    current.__wrapped__ = original
    copied = getattr(current, "__dict__", {})
    kept = getattr(original, "__dict__", {})
    for key, value in list(getattr(ours, "__dict__", {}).items()):
        if key != "__wrapped__" and key not in kept and copied.get(key, _MISSING) is value:
            del copied[key]  # functools.wraps copied our attributes onto it


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def shared_patch(key: str, owner: str, module, replacements) -> SharedPatch:
    """A :class:`SharedPatch`, registered for :func:`all_patches`.

    Example::

        >>> from deferinit.fake.assign import TENSOR_DATA
        >>> TENSOR_DATA in all_patches()
        True
    """
    patch = SharedPatch(key, owner, module, replacements)
    locked(_made_lock, _ALL.append, patch)
    return patch


def all_patches() -> tuple:
    """Every patch of the project (made so far)."""
    return tuple(_ALL)

