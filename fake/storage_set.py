"""``fake.set_(source, storage_offset, size, stride)`` and ``fake.set_(storage)``.

PyTorch turns ``t.set_(source_tensor, offset, size, stride)`` into
``set_(t, source.storage(), ...)`` in C++, before any Python dispatch: a fake
source would arrive as its wrapper's empty storage, which names no fake.  So
the tensor overload goes to the handler itself, undecomposed; its meta kernel
(and its replay) then decompose it on the shadows (and on real tensors),
growing the source's storage where the geometry needs more, as eagerly.

A real storage (``torch.load`` and ``pickle`` rebuild tensors with
``torch.empty(0).set_(storage, offset, size, stride)``) makes the fake real:
eagerly the result is a real tensor on that memory, aliasing whatever else
was loaded from it, and so it is here, the same Python object.
"""

from __future__ import annotations

import torch

from . import handlers
from .bypass import no_python_dispatch

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
