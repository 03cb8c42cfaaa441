"""The storage of a fake tensor: its shadow's meta storage, which knows its size.

Tools that account for memory (``MemTracker``, ``FSDPMemTracker``) and code
that manages memory by hand (FSDP2 frees and re-allocates its all-gather
buffers with ``untyped_storage().resize_()``) ask a tensor for its
storage, as they do of PyTorch's own fake tensors.  A fake answers with
the untyped storage of its shadow: PyTorch keeps one Python object per
storage, so the fakes that alias one memory (views, ``detach()``,
``.data``, in-place results) answer with the same object, which reports
the bytes the real memory would hold (``nbytes()``, ``size()``), takes
weak references, dies with its last alias and can be resized.

What it cannot do is hold data: the object is given the class
:class:`FakeStorage`, whose data accessors raise
:class:`~deferinit.fake.errors.FakeDataAccessError` instead of meta's bare
``NotImplementedError``.  Metadata methods, ``resize_`` included, are
inherited untouched, so a tool that patches ``UntypedStorage.resize_`` (as
``MemTracker`` does) still sees every resize.

``fake.set_(source, storage_offset, size, stride)``: PyTorch turns it into
``set_(t, source.storage(), ...)`` in C++, before any Python dispatch: a fake
source would arrive as its wrapper's empty storage, which names no fake.  So
the tensor overload goes to the handler itself, undecomposed; its meta kernel
(and its replay) then decompose it on the shadows (and on real tensors),
growing the source's storage where the geometry needs more, as eagerly.
``fake.set_(storage)`` with a real storage (``torch.load`` and ``pickle``
rebuild tensors with ``torch.empty(0).set_(storage, offset, size, stride)``)
makes the fake real: eagerly the result is a real tensor on that memory,
aliasing whatever else was loaded from it, and so it is here, the same
Python object.
"""

from __future__ import annotations

import torch

from . import handlers
from .bypass import no_python_dispatch
from .errors import FakeDataAccessError


def _refuse(operation: str):
    def method(self, *args, **kwargs):
        raise FakeDataAccessError(
            f"UntypedStorage.{operation}",
            f"(size={self.nbytes()} bytes: its storage)",
            "The storage of a fake tensor knows its size but holds no bytes; "
            "materialize the tensor first to read or write its memory.",
        )

    method.__name__ = operation.partition("(")[0]
    return method


class FakeStorage(torch.UntypedStorage):
    """The untyped storage of fake tensors: sizes, weak references and resizes
    work; reading or writing bytes raises :class:`~deferinit.fake.errors.FakeDataAccessError`.

    Example::

        >>> with fake_mode():
        ...     t = torch.ones(4, 4)
        >>> s = t.untyped_storage()
        >>> type(s).__name__, s.nbytes(), s is t[1:].untyped_storage()
        ('FakeStorage', 64, True)
        >>> s.tolist()
        Traceback (most recent call last):
        deferinit.fake.errors.FakeDataAccessError: UntypedStorage.tolist() needs the data of a fake tensor ...
    """

    tolist = _refuse("tolist()")
    __getitem__ = _refuse("__getitem__()")
    __setitem__ = _refuse("__setitem__()")
    __iter__ = _refuse("__iter__()")
    data_ptr = _refuse("data_ptr()")
    copy_ = _refuse("copy_()")
    fill_ = _refuse("fill_()")
    cpu = _refuse("cpu()")
    cuda = _refuse("cuda()")
    to = _refuse("to()")
    numpy = _refuse("numpy()")
    pin_memory = _refuse("pin_memory()")
    share_memory_ = _refuse("share_memory_()")
    _write_file = _refuse("_write_file()")
    __reduce__ = _refuse("pickling")
    __deepcopy__ = _refuse("copy.deepcopy()")

    def __repr__(self) -> str:
        return f"FakeStorage(nbytes={self.nbytes()})"


def storage_of(shadow: torch.Tensor) -> FakeStorage:
    """The storage of the fakes that ``shadow`` (a meta tensor) stands for.

    The same object for every alias of that memory, for as long as one lives.
    """
    storage = torch.Tensor.untyped_storage(shadow)
    if type(storage) is not FakeStorage:
        # PyTorch keeps this object while the storage lives: giving it our
        # class once is enough, and costs no copy.
        storage.__class__ = FakeStorage
    return storage


_STORAGES = (torch.UntypedStorage, torch.TypedStorage)
_NAMES = ("source", "storage_offset", "size", "stride")
_SET_TENSOR = torch.ops.aten.set_.source_Tensor_storage_offset


def fake_set_(self: torch.Tensor, args, kwargs, internal=frozenset()):
    """``Tensor.set_`` on a fake ``self`` (see the module docstring); ``internal``
    names the fake's own attributes, which a fake made real leaves behind.

    Example::

        >>> with fake_mode():
        ...     src = torch.arange(12.0)
        ...     t = torch.empty(0).set_(src, 2, (2, 3), (3, 1))
        >>> t.shape, t.stride(), t.storage_offset()
        (torch.Size([2, 3]), (3, 1), 2)
    """
    bound = dict(zip(_NAMES, args))
    bound.update(kwargs)
    source = bound.get("source")
    if isinstance(source, _STORAGES) and source.device.type != "meta":
        return _become_real(self, args, kwargs, source, internal)
    if (
        isinstance(source, torch.Tensor)
        and "storage_offset" in bound
        and not (self.requires_grad and torch.is_grad_enabled())  # eager's leaf error comes from C++
    ):
        call = (self, source, bound["storage_offset"], list(bound["size"]), list(bound.get("stride") or ()))
        result = handlers.for_args(call, None).dispatch(_SET_TENSOR, call, {}, None)
        torch._C._increment_version((self,))
        return result
    return torch.Tensor.set_(self, *args, **kwargs)


def _become_real(fake: torch.Tensor, args, kwargs, storage, internal) -> torch.Tensor:
    if storage.device != fake.device:
        raise RuntimeError(
            f'Attempted to set the storage of a tensor on device "{fake.device}" to a storage on '
            f'different device "{storage.device}".  This is no longer allowed; the devices must match.'
        )
    with no_python_dispatch():
        real = torch.empty(0, dtype=fake.dtype, device=storage.device)
        real.set_(*args, **kwargs)
        d = fake.__dict__
        requires_grad = fake.requires_grad
        if d.get("_is_param"):
            # PyTorch's own, not the diversion held while fakes live (subclass.py): real is real.
            real = torch._C.TensorBase._make_subclass(d.get("_param_cls") or torch.nn.Parameter, real, requires_grad)
        elif requires_grad:
            real.requires_grad_(True)
        for key, value in d.items():
            if key not in internal:
                real.__dict__[key] = value
        for name in ("__class__", "__dict__"):
            mine, theirs = getattr(fake, name), getattr(real, name)
            setattr(fake, name, theirs)
            setattr(real, name, mine)
        torch._C._swap_tensor_impl(fake, real)
    return fake
