"""Putting real tensors into the Python objects that were fake, all or nothing.

Exchanging the contents of two tensor objects (as ``torch.utils.swap_tensors`` does),
so every reference held anywhere (a module, an optimizer, a tied module, a
user variable) sees the real tensor afterwards.  The real tensor is first
dressed as the fake was: its class (``nn.Parameter`` or a subclass),
``requires_grad`` and the user's attributes (``_is_hf_initialized``...).
A swap that fails undoes the ones before it.  References from C++ to a
fake (the base of a fake view, an autograd graph built on fakes) keep
pointing to the fake's old C++ tensor, which only ever described shapes.
"""

from __future__ import annotations

import torch

from deferinit.errors import MaterializationError
from deferinit.fake.assign import _hooks_follow, exchange
from deferinit.fake.bypass import plain_queries
from deferinit.fake.tensor import INTERNAL_ATTRS

from .errors import AutogradMaterializationError
from .autograd import grad_fn_of, is_grad_view


def dress(fake: torch.Tensor, real: torch.Tensor, inference: bool, made: torch.Tensor | None = None,
          retaken: bool = False) -> torch.Tensor:
    """A new tensor object on ``real``'s memory that looks like ``fake`` did.

    Eager's facts, as the fake holds them: an inference tensor (made under
    ``torch.inference_mode()``, or asked for with ``inference=True``) comes
    out as a true inference tensor (no version counter, read-only outside
    inference mode) and keeps ``requires_grad`` when it is a leaf (an
    ``nn.Parameter`` built in inference mode requires grad); a tensor that
    is not a leaf keeps the graph replay gave it (``real`` itself); a leaf
    is a new object, or ``made``, the one replay already computed on.
    A view ``retaken`` from a real base (materialized before) is ``real``
    itself: it requires grad as that base now does, as eagerly (the fake's
    own flags are stale once its base is real).
    """
    d = fake.__dict__
    floating = real.is_floating_point() or real.is_complex()
    cls = _class_of(d)
    grad_fn = grad_fn_of(fake)
    # is_grad_view(fake), asked once (grad_fn is its first question).
    grad_view = grad_fn is None and is_grad_view(fake)
    if inference or fake.is_inference():
        # Eager construction under inference_mode() records no graph: what
        # required grad as a leaf still does, the rest does not.
        requires_grad = fake.requires_grad and grad_fn is None and not grad_view and floating
        with torch.inference_mode():
            if not real.is_inference():
                # A new tensor allocated in inference mode is an inference
                # tensor; on the same memory it costs nothing.
                real = torch.empty(0, dtype=real.dtype, device=real.device).set_(
                    real.untyped_storage(), real.storage_offset(), real.size(), real.stride()
                )
            obj = _leaf(cls, real, requires_grad)
    elif made is not None:
        obj = made
        if cls is not None and type(obj) is not cls:
            obj.__class__ = cls  # made as the base of views (deferinit.materialize.autograd.Binder)
    elif retaken and real._is_view():
        obj = real
    elif grad_view and not (real.requires_grad and real._is_view()):
        # A view taken under no_grad that replay could not take again from
        # its base: a leaf that requires grad, as before its base was known.
        with torch.inference_mode(False):
            obj = _leaf(cls, real, floating)
    elif grad_fn is not None or grad_view:
        if not real.requires_grad:
            raise AutogradMaterializationError(
                f"a tensor computed from tensors that require grad ({type(grad_fn).__name__}) "
                "came out of the replay without its autograd graph: materialize them in one "
                "materialize_module call. Nothing was changed."
            )
        obj = real
        if cls is not None and type(obj) is not cls:
            # A parameter written in place under grad mode (``p.set_(q)``):
            # eagerly the same Parameter object, now with a grad_fn.
            obj.__class__ = cls
    elif torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            obj = _leaf(cls, real, fake.requires_grad and floating)
    else:  # the common case, without the context manager's cost (a model of many small tensors)
        obj = _leaf(cls, real, fake.requires_grad and floating)
    if not d.keys() <= INTERNAL_ATTRS:  # the user's attributes (most tensors have none)
        _copy_attributes(d, obj)
    return obj


def dress_leaf(fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """:func:`dress` of a fake that is a leaf, not a view and not an inference
    tensor, made real outside inference mode as a tensor that is no view:
    its common case, asked nothing else (a model of many small tensors).

    Example::

        >>> w = deferred_init(torch.nn.Linear, 2, 2).weight
        >>> type(dress_leaf(w, torch.zeros(2, 2))).__name__
        'Parameter'
    """
    d = fake.__dict__
    cls = _class_of(d)
    obj = _leaf(cls, real, fake.requires_grad and (real.is_floating_point() or real.is_complex()))
    if not d.keys() <= INTERNAL_ATTRS:  # the user's attributes (most tensors have none)
        _copy_attributes(d, obj)
    return obj


def dress_fresh(fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """:func:`dress_leaf` of a tensor nothing else holds (a replay's fresh
    factory output, no view, no graph): ``real`` itself is dressed, its class
    set and ``requires_grad`` turned on, as ``_make_subclass`` would give a
    new object (a model of many small tensors makes one object less each).
    A class with a dispatch of its own, or a layout of its own, gets a new
    object (:func:`dress_leaf`).

    Example::

        >>> w = deferred_init(torch.nn.Linear, 2, 2).weight
        >>> t = torch.zeros(2, 2); dress_fresh(w, t) is t, type(t).__name__, t.requires_grad
        (True, 'Parameter', True)
    """
    d = fake.__dict__
    cls = _class_of(d)
    if cls is not None and getattr(cls, "__torch_dispatch__", _DEFAULT_DISPATCH) is not _DEFAULT_DISPATCH:
        return dress_leaf(fake, real)
    if _requires_grad(fake) and (real.is_floating_point() or real.is_complex()):
        real.requires_grad_(True)  # while still a plain tensor: no class of the user's asked
    if cls is not None:
        try:
            object.__setattr__(real, "__class__", cls)
        except TypeError:  # "object layout differs" (__slots__): a new object, refused at its swap
            return dress_leaf(fake, real)
    if not d.keys() <= INTERNAL_ATTRS:  # the user's attributes (most tensors have none)
        _copy_attributes(d, real)
    return real


_DEFAULT_DISPATCH = torch.Tensor.__torch_dispatch__
_requires_grad = torch._C.TensorBase.requires_grad.__get__


def _class_of(d: dict):
    """The class a fake's real tensor is dressed as, from the fake's ``__dict__``
    ``d``: a Parameter (or subclass), or a tensor subclass made from a fake
    (deferinit.fake.subclass); None for a plain tensor."""
    return (d.get("_param_cls") or torch.nn.Parameter) if d.get("_is_param") else d.get("_param_cls")


def _copy_attributes(d: dict, obj: torch.Tensor) -> None:
    """The user's attributes of a fake (its ``__dict__`` ``d``, less the fake's own) onto ``obj``."""
    for key, value in d.items():
        if key not in INTERNAL_ATTRS:
            obj.__dict__[key] = value


def _leaf(cls, real: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    if cls is not None:
        # PyTorch's own, not the diversion torch.Tensor holds while fakes live
        # (fake/subclass.py): ``real`` is real, and this runs once per tensor.
        return _make_subclass(cls, real, requires_grad)
    obj = real.detach()
    if requires_grad:
        obj.requires_grad_(True)
    return obj


_make_subclass = torch._C.TensorBase._make_subclass


def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """Exchange the contents of two tensor objects (class, attributes, C++ tensor).

    ``torch.utils.swap_tensors`` without its refusals, which protect autograd
    graphs of real tensors: a weak reference to a fake
    (``nn.RNNBase._flat_weight_refs`` keeps them) should follow the object,
    and C++ references to a fake (a view's base) describe nothing real.
    Gradient hooks registered on the fake stay with the object, as they
    would on the eagerly built tensor (see :func:`deferinit.fake.assign.exchange`).
    """
    exchange(t1, t2)


class Swaps:
    """The swaps of one materialization and what they change besides, all or nothing.

    Right before an object is swapped, its class, ``__dict__`` and C++
    tensor are noted; :meth:`undo` puts every object back by comparing what
    it holds now with those notes, so it undoes exactly what was done,
    whatever line an interrupt stopped at (in the middle of one exchange
    too: its class swapped and its C++ tensor not yet).  The storages
    remembered real (``run(remember=...)``) get their earlier memory back.

    ``wrappers`` (innermost first) are the wrapper subclasses (see
    :mod:`deferinit.wrappers`) built around the fakes: their device, and
    whatever their constructor derived from the fakes, describe fakes.  Once
    the pairs are swapped, each class's own ``__tensor_unflatten__`` builds
    the wrapper again from the same inner objects, now real (:func:`rebuilt`),
    and that is swapped into the old object, which keeps its identity,
    ``requires_grad`` and the attributes its class does not set
    (``_is_param``, a user's tags), as eagerly; undone with the rest.

    Example::

        >>> a, b = torch.zeros(2), torch.ones(3)
        >>> swaps = Swaps([(a, b)])
        >>> swaps.run(); a.shape
        torch.Size([3])
        >>> swaps.undo(); a.shape, b.shape
        (torch.Size([2]), torch.Size([3]))
        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> t = deferred_init(lambda: TwoTensor(torch.zeros(2), torch.ones(2)))
        >>> materialize_tensor(t) is t, type(t).__name__, is_deferred(t), t.a.tolist()
        (True, 'TwoTensor', False, [0.0, 0.0])
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]] = (), wrappers=()):
        # The pairs :meth:`run` swaps (those given to it otherwise).
        self.pending = list(pairs)
        # The pairs swapped (or being swapped), each with its note, taken right
        # before its swap, at the same index of ``before`` (:meth:`undo` pairs them up).
        self.pairs: list = []
        self.before: list = []
        self.wrappers = list(wrappers)
        self.storages: list = []

    def run(self, remember=None, pairs=None) -> None:
        """Swap each ``(fake, dressed_real)`` pair (``pairs``, default: those given
        at construction), then rebuild the wrappers around them; undo
        everything if one fails.  ``remember``: per pair, ``(read, storage)``
        whose storage learns its real memory once swapped (undone with the
        rest), or None; one pass over the pairs does both."""
        if pairs is None:
            pairs, self.pending = self.pending, []
        try:
            with plain_queries():  # fakes and the tensors dressed for them
                for i, (fake, real) in enumerate(pairs):
                    self._swap(fake, real, None if remember is None else remember[i])
        except Exception as e:
            self.undo()
            raise MaterializationError(f"swapping the real tensors in failed: {e}; nothing was changed") from e
        w = None
        before = self.before
        try:
            for w in self.wrappers:
                new = rebuilt(w)
                # Noted before the swap: an interrupt between the two leaves
                # a note without a pair (zip ignores it) or a pair not swapped.
                before.append(_noted(w, new))
                self.pairs.append((w, new))
                swap(w, new)
        except Exception as e:
            self.undo()
            raise MaterializationError(
                f"rebuilding a {type(w).__name__} around its materialized inner tensors failed "
                f"({type(e).__name__}: {e}); nothing was changed"
            ) from e

    def one(self, fake: torch.Tensor, real: torch.Tensor, remember=None) -> None:
        """Swap one pair now, as :meth:`run` does (a replay handing its tensors
        over as they are made); undone with the rest."""
        try:
            self._swap(fake, real, remember)
        except Exception as e:
            self.undo()
            raise MaterializationError(f"swapping the real tensors in failed: {e}; nothing was changed") from e

    def _swap(self, fake, real, remember) -> None:
        # Pair, then note, then swap: an interrupt between leaves a pair
        # without a note (zip ignores it) or a note of what is still so.
        self.pairs.append((fake, real))
        self.before.append(_noted(fake, real))
        exchange(fake, real)  # swap()'s body, one call less per tensor
        if remember is not None:
            read, storage = remember
            self.storages.append((storage, storage.real, storage.real_head))
            _remember(read, storage, fake)

    def undo(self) -> None:
        """Put every object and storage back as before (idempotent)."""
        for storage, real, head in reversed(self.storages):
            storage.real, storage.real_head = real, head
        # The wrappers (noted last) first: each was rebuilt from inner tensors swapped before it.
        for (a, b), (cls_a, dict_a, cdata_a, cls_b, dict_b) in reversed(list(zip(self.pairs, self.before))):
            if a._cdata != cdata_a:
                torch._C._swap_tensor_impl(a, b)
            if a.__dict__ is not dict_a:
                a.__dict__, b.__dict__ = dict_a, dict_b
            if type(a) is not cls_a or type(b) is not cls_b:
                a.__class__, b.__class__ = cls_a, cls_b
            _hooks_follow(a, b)


def _noted(a: torch.Tensor, b: torch.Tensor) -> tuple:
    return type(a), a.__dict__, _cdata(a), type(b), b.__dict__


# Unbound: looked up on a subclass's instance (a fake) it costs as much again.
_cdata = torch._C.TensorBase._cdata.__get__


def rebuilt(w: torch.Tensor) -> torch.Tensor:
    """A new ``type(w)`` built by its ``__tensor_unflatten__`` from ``w``'s inner
    objects and flatten context, with ``w``'s geometry, ``requires_grad`` and
    the attributes of ``w`` the class does not set itself."""
    names, ctx = w.__tensor_flatten__()
    new = type(w).__tensor_unflatten__({name: getattr(w, name) for name in names}, ctx, w.size(), w.stride())
    if new.requires_grad != w.requires_grad:
        new.requires_grad_(w.requires_grad)
    d = new.__dict__
    for key, value in w.__dict__.items():
        if key not in d:
            d[key] = value
    return new


def _remember(read, storage, real) -> None:
    """After a swap: a recorded storage remembers its real memory and the head it
    reflects, so that its other tensors, materialized later, share it."""
    if type(real) is not torch.Tensor and type(real) is not torch.nn.Parameter:
        # A subclass may refuse .shape (lazy modules' placeholders): ask a plain alias.
        with torch._C.DisableTorchFunctionSubclass():
            real = real.as_subclass(torch.Tensor)
    if storage.real is None and read.value.same_geometry(real):
        storage.real = real.untyped_storage()
    if storage.real is not None:
        storage.real_head = read.version
