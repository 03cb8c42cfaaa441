"""Tensor subclasses made from fakes: ``torch.Tensor._make_subclass(cls, fake)``.

Parameter subclasses with a ``__new__`` of their own (bitsandbytes'
``Int8Params``) and the placeholders of lazy modules
(``UninitializedParameter``, ``UninitializedBuffer``) call
``torch.Tensor._make_subclass(cls, data, requires_grad)``.  On a fake, C++
would bind a second Python object to the fake's C++ tensor and fail ("already
associated to a python object").  While a fake mode is active (fake_mode,
deferred_init) or a fake is alive, ``_make_subclass`` is diverted: for fake
data it returns a new fake with the same value whose class derives from both
``FakeTensor`` and ``cls`` (``isinstance(p, Int8Params)`` holds, ``cls``'s
methods are there), and remembers ``cls``, so that materialization gives back
an instance of ``cls`` itself.  Anything else goes to PyTorch's own
``_make_subclass``.  A fake alive holds the diversion because a deferred
model meets these classes after the block too (transformers' quantizers make
``Int8Params(weight)`` of the model's deferred weights), and is recorded
there as any operation on it.

Lazy placeholders stay lazy: ``materialize(shape)`` at the first forward
gives them a fake (deferred, when they are) of that shape, and turns them
into the plain fake parameter or buffer that PyTorch would turn them into.
"""

from __future__ import annotations

import sys

import torch
from torch.nn.parameter import Parameter, UninitializedTensorMixin

from .alive import hold_while_fakes_live
from .patch import shared_patch
from .tensor import FakeTensor

_original = torch._C.TensorBase._make_subclass
_classes: dict = {}


def make_subclass(cls, data, require_grad=False, *args, **kwargs):
    """``torch.Tensor._make_subclass`` that also takes fakes (see the module docstring).

    Example::

        >>> class Tagged(torch.nn.Parameter):
        ...     def __new__(cls, data):
        ...         return make_subclass(cls, data, True)
        >>> with fake_mode():
        ...     p = Tagged(torch.ones(2))
        >>> isinstance(p, Tagged), is_fake(p), p.requires_grad
        (True, True, True)
    """
    if not isinstance(data, FakeTensor) or args or kwargs:
        return _original(cls, data, require_grad, *args, **kwargs)
    out = data.detach()  # the same value under a new object, as _make_subclass's own detach
    if require_grad:
        out.requires_grad_(True)
    if cls is Parameter:
        out._is_param = True  # what Parameter(fake) gives
        out.__dict__["_param_cls"] = cls
        return out
    if cls is torch.Tensor or cls is FakeTensor:
        return out
    out.__class__ = fake_class(cls)
    remember_class(out, cls)
    return out


def remember_class(fake: FakeTensor, cls) -> None:
    """Remember ``cls`` as what materialization dresses ``fake``'s real tensor as
    (see materialize.swap): a ``Parameter`` class also flags it as a parameter.

    Example::

        >>> with fake_mode():
        ...     t = torch.ones(2)
        >>> remember_class(t, torch.nn.Parameter)
        >>> isinstance(t, torch.nn.Parameter), t.__dict__["_param_cls"].__name__
        (True, 'Parameter')
    """
    d = fake.__dict__
    d["_param_cls"] = cls
    if issubclass(cls, Parameter):
        d["_is_param"] = True
    else:
        d.pop("_is_param", None)


# Methods of FakeTensor that a subclass's own version overrides on its fakes:
# moving between devices, which some classes make a conversion (bitsandbytes'
# Int8Params and Params4bit quantize on .to()).  Eagerly the class's method
# runs; on a fake it runs too, and what it computes is recorded like any op.
_OWN_MOVES = ("to", "cuda", "cpu")


def _own_moves(cls) -> dict:
    """``{name: function}`` for the device moves ``cls`` defines itself (below
    ``nn.Parameter`` and ``torch.Tensor``)."""
    found = {}
    for name in _OWN_MOVES:
        for klass in cls.__mro__:
            if klass in (Parameter, torch.Tensor, torch._C.TensorBase, object) or issubclass(FakeTensor, klass):
                break
            if name in vars(klass):
                found[name] = vars(klass)[name]
                break
    return found


def fake_class(cls):
    """The class of a fake that is also a ``cls``: ``FakeTensor`` first, so that
    every operation stays fake, except the device moves ``cls`` defines itself
    (a conversion, such as a quantization on ``.to()``), which run as eagerly."""
    made = _classes.get(cls)
    if made is None:
        namespace = {"__module__": __name__, "__qualname__": f"fake_class({cls.__qualname__})", "_fake_class_of": cls}
        namespace.update(_own_moves(cls))
        if issubclass(cls, UninitializedTensorMixin):
            namespace["materialize"] = _materialize
            namespace["__repr__"] = UninitializedTensorMixin.__repr__
        made = _classes[cls] = type(cls.__name__, (FakeTensor, cls), namespace)
    return made


def _materialize(self, shape, device=None, dtype=None) -> None:
    """``UninitializedTensorMixin.materialize`` for a fake placeholder: a fake of
    ``shape`` (recorded like any op on a deferred fake), then the class PyTorch
    gives (``cls_to_become``)."""
    become = self.cls_to_become
    self.data = self.new_empty(shape, device=device, dtype=dtype)
    self.__class__ = FakeTensor
    if become is torch.Tensor:
        self.__dict__.pop("_param_cls", None)
    else:
        remember_class(self, become)


class _Diversion(staticmethod):
    """``torch.Tensor._make_subclass`` while some thread is in a fake mode or a
    fake is alive: ours (which hands anything but a fake to PyTorch's own).

    Two readers get PyTorch's own instead.  ``torch._dynamo``'s import, which
    registers the builtin itself for its polyfill (it may be first imported
    in the middle of a recording): the caller's frame is read because no
    protocol serves, a descriptor is told the object and class it is read
    from, never who reads it.  And dynamo tracing a compiled function, which
    reads class attributes statically (``inspect.getattr_static``): it finds
    a ``staticmethod`` of PyTorch's own function and traces that, so a
    compiled ``nn.Parameter(x)`` keeps its full graph while fakes live."""

    def __init__(self):
        super().__init__(_original)

    def __get__(self, obj, owner=None):
        caller = sys._getframe(1)
        if caller.f_code.co_name == "<module>" and caller.f_globals.get("__name__", "").startswith("torch._dynamo"):
            return _original
        return make_subclass


#: Installed while any thread is in a fake mode, and while any fake is alive
#: (reference counted; fake/alive.py).
MAKE_SUBCLASS = shared_patch("make subclass", "torch.Tensor", lambda: torch.Tensor, lambda _: {"_make_subclass": _Diversion()})


hold_while_fakes_live(MAKE_SUBCLASS)


class accepting_fakes:
    """``torch.Tensor._make_subclass`` takes fakes for the block, held as
    ``holder`` (a :class:`~deferinit.fake.guard.Entry`, which releases the
    hold if the block's exit is interrupted).  A class, not a generator (see
    :mod:`deferinit.fake.guard`)."""

    __slots__ = ("holder",)

    def __init__(self, holder) -> None:
        self.holder = holder

    def __enter__(self) -> None:
        MAKE_SUBCLASS.acquire(self.holder)

    def __exit__(self, *exc) -> None:
        try: MAKE_SUBCLASS.release(self.holder)  # noqa: E701 - one line each: see deferinit.fake.guard
        finally: MAKE_SUBCLASS.release(self.holder)  # noqa: E701
