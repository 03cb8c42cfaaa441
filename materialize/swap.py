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
from fake.tensor import INTERNAL_ATTRS


def dress(fake: torch.Tensor, real: torch.Tensor, inference: bool) -> torch.Tensor:
    """A new tensor object on ``real``'s memory that looks like ``fake`` did."""
    d = fake.__dict__
    requires_grad = fake.requires_grad and (real.is_floating_point() or real.is_complex())
    if d.get("_is_param"):
        cls = d.get("_param_cls") or torch.nn.Parameter
        obj = torch.Tensor._make_subclass(cls, real, requires_grad and not inference)
    else:
        obj = real.detach()
        if requires_grad and not inference:
            obj.requires_grad_(True)
    for key, value in d.items():
        if key not in INTERNAL_ATTRS:
            obj.__dict__[key] = value
    return obj


def swap(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """Exchange the contents of two tensor objects (class, attributes, C++ tensor).

    ``torch.utils.swap_tensors`` without its refusals, which protect autograd
    graphs of real tensors: a weak reference to a fake
    (``nn.RNNBase._flat_weight_refs`` keeps them) should follow the object,
    and C++ references to a fake (a view's base) describe nothing real.
    """
    for name in ("__class__", "__dict__"):
        a, b = getattr(t1, name), getattr(t2, name)
        setattr(t1, name, b)
        setattr(t2, name, a)
    torch._C._swap_tensor_impl(t1, t2)


def swap_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Swap each ``(fake, dressed_real)`` pair; undo everything if one fails."""
    done = []
    try:
        for fake, real in pairs:
            swap(fake, real)
            done.append((fake, real))
    except Exception as e:
        for fake, real in reversed(done):
            swap(fake, real)
        raise MaterializationError(f"swapping the real tensors in failed: {e}; nothing was changed") from e


def remember_real_storages(reads, storages, reals) -> None:
    """After a swap: each recorded storage remembers its real memory and the
    head it reflects, so that its other tensors, materialized later, share it."""
    for read, storage, real in zip(reads, storages, reals):
        if storage.real is None and read.value.same_geometry(real):
            storage.real = real.untyped_storage()
        if storage.real is not None:
            storage.real_head = read.version
