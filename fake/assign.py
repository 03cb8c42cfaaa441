"""A real tensor given a fake's memory: ``real.data = fake``, ``real.set_(fake, ...)``.

Eagerly ``p.data = t`` makes ``p`` share ``t``'s memory and keeps ``p`` itself:
its identity, class, ``requires_grad`` and attributes
(``torch.nn.utils.vector_to_parameters``, ``Module._apply``, PEFT's PiSSA and
OLoRA initialisations do it).  In C++ that copies ``t``'s tensor fields into
``p``; for a fake ``t``, which has no memory, ``p`` would look real, hold
nothing, and crash the process at the first kernel that reads it.  The C++
setter, like the C++ decomposition of ``p.set_(t, offset, size, stride)``,
never asks ``t``'s class, so ``torch.Tensor.data`` and ``torch.Tensor.set_``
are replaced while fakes are alive (:mod:`deferinit.fake.alive`: from the first
fake made to the last one gone; a process without fakes keeps PyTorch's
own), by versions that hand an operation with a fake argument on a real
tensor to this module; everything else goes straight to PyTorch's own.

Here ``p`` becomes a fake in place (the same Python object, with its class
remembered for materialization, its ``requires_grad`` and its attributes),
on ``t``'s memory: a deferred fake when ``t`` is deferred, so that
materialization computes it, aliasing ``t`` as eagerly.  Its gradient
hooks stay too: eagerly they belong to ``p``, whatever its data.  What
eager refuses (an integer ``t`` for a ``p`` that requires grad, tensors of
incompatible kinds, ``set_`` across dtypes or devices) raises eager's
error; what cannot become a fake (a tensor with a ``.grad``, a non-leaf, a
view, a tensor subclass with a dispatch of its own or with ``__slots__``)
raises :class:`~deferinit.fake.errors.FakeIntoRealError`; both leave ``p`` as it was.
"""

from __future__ import annotations

import torch

from .alive import hold_while_fakes_live
from .errors import FakeIntoRealError
from .patch import shared_patch
from .subclass import fake_class, remember_class
from .tensor import FakeTensor, describe

_DATA = torch._C.TensorBase.data
_SET = torch._C.TensorBase.set_
_DEFAULT_DISPATCH = torch.Tensor.__torch_dispatch__


def _set_data(self, new) -> None:
    if isinstance(new, FakeTensor) and not isinstance(self, FakeTensor):
        _check_data(self, new)
        become_fake(self, new, "tensor.data = fake")
        return
    _DATA.__set__(self, new)


def _set_(self, *args, **kwargs):
    if not isinstance(self, FakeTensor):
        source = kwargs.get("source", args[0] if args else None)
        if isinstance(source, FakeTensor):
            _check_set(self, source, len(args) + len(kwargs) > 1)
            return _as_fake_then(self, source, "tensor.set_(fake)", lambda: self.set_(*args, **kwargs))
    return _SET(self, *args, **kwargs)


# Pickled by reference as what it stands for (torch.Tensor.set_), as PyTorch's own is.
_set_.__doc__ = _SET.__doc__
_set_.__name__ = "set_"
_set_.__qualname__ = "Tensor.set_"
_set_.__module__ = "torch"

#: ``torch.Tensor.data``: PyTorch's getter, and a setter that sends fakes here.
DATA = property(_DATA.__get__, _set_data, doc=_DATA.__doc__)

#: :data:`DATA` and the ``set_`` above on ``torch.Tensor``, held while fakes live (fake/alive.py).
TENSOR_DATA = shared_patch(
    "tensor data", "torch.Tensor", lambda: torch.Tensor, lambda _: {"data": DATA, "set_": _set_}
)
hold_while_fakes_live(TENSOR_DATA)


# The backends whose dense tensors eager lets share .data (TensorImpl's
# has_compatible_shallow_copy_type); a fake stands for a dense tensor.
_DENSE = frozenset({"cpu", "cuda", "mps", "hip", "xpu", "hpu"})


def _check_data(self, new) -> None:
    # Eager's own checks (VariableHooks::set_data), before anything changes.
    dense = self.layout == torch.strided and not self.is_quantized and not self.is_nested
    if not (dense and (self.device.type == new.device.type or {self.device.type, new.device.type} <= _DENSE)):
        raise RuntimeError(
            "Attempted to call `variable.set_data(tensor)`, but `variable` and `tensor` have incompatible tensor type."
        )
    if self.requires_grad and not (new.is_floating_point() or new.is_complex()):
        raise RuntimeError("data set to a tensor that requires gradients must be floating point or complex dtype")


def _check_set(self, source, geometry: bool) -> None:
    # Eager's own checks of set_(source[, offset, size, stride]): the same device,
    # and for the tensor overload the same dtype.
    if self.device != source.device:
        raise RuntimeError(
            f'Attempted to set the storage of a tensor on device "{self.device}" to a storage on '
            f'different device "{source.device}".  This is no longer allowed; the devices must match.'
        )
    if self.dtype != source.dtype:
        if not geometry:
            raise RuntimeError(f"Could not set tensor of type {source.dtype} to a tensor of type {self.dtype}")
        raise FakeIntoRealError(
            f"tensor.set_(fake, offset, size, stride): would read the memory of the fake tensor "
            f"{describe(source)} as {self.dtype}, the dtype of the real tensor {describe(self)}; "
            "a fake's memory cannot be reinterpreted as another dtype. View the source as that "
            "dtype first (fake.view(dtype)), or materialize it first (materialize_tensor)."
        )


def _as_fake_then(real, like, operation: str, op):
    """Make ``real`` a fake aliasing ``like``, then run ``op`` on it; undone if ``op`` fails."""
    undo = become_fake(real, like, operation)
    try:
        return op()
    except BaseException:
        undo()
        raise


def become_fake(real: torch.Tensor, like: FakeTensor, operation: str):
    """Turn ``real`` into a fake sharing ``like``'s memory, in place; returns an undo.

    The Python object stays the same; its class becomes one that
    materialization turns back into ``type(real)``; ``requires_grad`` and the
    user's attributes stay.  Raises :class:`FakeIntoRealError` (``real``
    unchanged) for what could not be given back as it was.

    Example::

        >>> with fake_mode():
        ...     f = torch.ones(2, 3)
        >>> t = torch.zeros(5)
        >>> _ = become_fake(t, f, "example")
        >>> is_fake(t), t.shape
        (True, torch.Size([2, 3]))
    """
    _refuse_unless_leaf(real, like, operation)
    cls = type(real)
    # Under inference_mode a new fake would be an inference tensor, which
    # real (refused if it is one) is not: eagerly it stays what it was.
    with torch.inference_mode(False):
        stand = like.detach()  # the same value under a new fake object
        if real.requires_grad:
            stand.requires_grad_(True)
    if cls is not torch.Tensor:
        if cls is not torch.nn.Parameter:
            try:
                stand.__class__ = fake_class(cls)
            except TypeError as e:  # a layout a fake cannot take (__slots__)
                raise FakeIntoRealError(
                    f"{operation}: the real tensor {describe(real)} would become a fake, but its class "
                    f"{cls.__name__} cannot ({e}). Create it inside deferred() too, or materialize the "
                    "source first (materialize_tensor)."
                ) from None
        remember_class(stand, cls)
    for key, value in real.__dict__.items():
        stand.__dict__.setdefault(key, value)
    exchange(real, stand)
    return lambda: exchange(real, stand)


def exchange(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange two tensor objects' contents: class, ``__dict__`` and C++ tensor;
    each object keeps its gradient hooks.

    ``torch.utils.swap_tensors`` leaves the hooks of ``register_hook`` and
    ``register_post_accumulate_grad_hook`` on the Python object but moves the
    autograd hooks that call them with the C++ tensor: the object's
    gradients would skip its hooks.  Here they are attached to the C++
    tensor each object holds afterwards (materialization swaps the same way).

    Example::

        >>> a, b = torch.zeros(2, requires_grad=True), torch.ones(3, requires_grad=True)
        >>> _ = a.register_hook(lambda g: g * 10)
        >>> exchange(a, b)
        >>> a.sum().backward()
        >>> a.shape, a.grad
        (torch.Size([3]), tensor([10., 10., 10.]))
    """
    # object's setattr: the classes' own (a fake's) would be asked about names it does not watch.
    class_a, class_b, dict_a, dict_b = type(a), type(b), a.__dict__, b.__dict__
    _set(a, "__class__", class_b)
    _set(b, "__class__", class_a)
    _set(a, "__dict__", dict_b)
    _set(b, "__dict__", dict_a)
    torch._C._swap_tensor_impl(a, b)
    _hooks_follow(a, b)


_set = object.__setattr__


# Unbound: looked up on a subclass's instance (a fake) they cost as much again.
_backward_hooks = torch._C.TensorBase._backward_hooks.__get__
_post_accumulate_grad_hooks = torch._C.TensorBase._post_accumulate_grad_hooks.__get__


def _hooks_follow(a: torch.Tensor, b: torch.Tensor) -> None:
    ha, hb = _backward_hooks(a), _backward_hooks(b)
    if ha is not None or hb is not None:
        # The setter puts the C++ hook that calls them on the tensor held now.
        a._backward_hooks, b._backward_hooks = ha, hb
    ha, hb = _post_accumulate_grad_hooks(a), _post_accumulate_grad_hooks(b)
    if ha is not None or hb is not None:
        a._post_accumulate_grad_hooks, b._post_accumulate_grad_hooks = ha, hb


def _refuse_unless_leaf(real: torch.Tensor, like: FakeTensor, operation: str) -> None:
    cls = type(real)
    if getattr(cls, "__torch_dispatch__", _DEFAULT_DISPATCH) is not _DEFAULT_DISPATCH:
        why = f"it is a {cls.__name__}, a tensor subclass with a dispatch of its own, which cannot hold a fake"
    elif real.grad is not None:
        why = "it has a .grad, which a tensor without values cannot keep (set .grad = None first)"
    elif real.grad_fn is not None or real._base is not None:
        why = "it is not a leaf (it has a grad_fn or is a view), and its autograd history cannot be kept"
    elif real.is_inference():
        why = "it is an inference tensor"
    else:
        return
    raise FakeIntoRealError(
        f"{operation}: would give the real tensor {describe(real)} the memory of the fake "
        f"tensor {describe(like)}, which has none, but {why}. A real tensor given a fake's "
        "memory becomes that fake, in place (materialization then computes it); assign to a "
        "leaf tensor without .grad, create the destination inside deferred() too, or "
        "materialize the source first (materialize_tensor)."
    )
