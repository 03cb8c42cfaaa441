"""Which handler computes an operation on fake tensors.

Plain fakes are computed by :class:`deferinit.fake.dispatch.FakeHandler`.  A fake whose
recipe is recorded (``_record`` set by ``deferinit``) needs the recorder to
see every operation that touches it, also outside ``deferred_init``; the
recorder registers itself here, so that this layer never imports the one
above it.
"""

from __future__ import annotations

_plain = None
_deferred = None


def set_plain(handler) -> None:
    global _plain
    _plain = handler


def register_deferred(handler) -> None:
    """Install the handler for fakes that carry a record (done by ``deferinit``)."""
    global _deferred
    _deferred = handler


def plain():
    return _plain


def _is_deferred(x) -> bool:
    return getattr(x, "_record", None) is not None


def for_args(args, kwargs):
    """The handler for an operation on ``args``/``kwargs``: the recorder as soon as
    one argument is a recorded fake, else the plain handler."""
    if _deferred is not None:
        for a in args:
            if _is_deferred(a):
                return _deferred
            if type(a) in (list, tuple):
                for b in a:
                    if _is_deferred(b):
                        return _deferred
        if kwargs:
            for a in kwargs.values():
                if _is_deferred(a):
                    return _deferred
    return _plain


_explainer = None


def register_data_access_explainer(fn) -> None:
    """Install ``fn(error, fake)`` (done by ``deferinit``): for a data or memory
    access on a recorded fake, it returns an error that says better why the
    access happened and what fixes it (a library's idiom that missed a step),
    or None to keep ``error``."""
    global _explainer
    _explainer = fn


def explain_data_access(error, fake):
    """``error`` (a :class:`~deferinit.fake.errors.FakeDataAccessError` about ``fake``), or
    the registered explainer's better one when ``fake`` is recorded."""
    if _explainer is not None and _is_deferred(fake):
        better = _explainer(error, fake)
        if better is not None:
            better.__cause__ = error
            return better
    return error
