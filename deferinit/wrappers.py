"""Wrapper tensor subclasses hold deferred tensors inside: found through ``__tensor_flatten__``.

A traceable wrapper subclass (the protocol ``torch.compile`` and FSDP2 ask
of subclasses: ``__tensor_flatten__``, ``__tensor_unflatten__`` and a
``__torch_dispatch__``) owns no memory; its values live in *inner* tensors
(a quantized tensor's data and scales, a DTensor's local shard), which its
``__torch_dispatch__`` computes on.  Made inside a deferral, such a wrapper
holds deferred fakes inside: the wrapper itself is recorded by nothing, its
inner tensors are recorded like any tensor.  So a tensor is deferred when a
fake is found inside it, and materializing it means materializing its inner
tensors and rebuilding the wrapper around them (``materialize/swap.py``).

Example::

    >>> from torch.testing._internal.two_tensor import TwoTensor
    >>> from deferinit import deferred
    >>> with deferred():
    ...     t = TwoTensor(torch.zeros(2), torch.ones(2))
    >>> [path for path, _ in inner_tensors(t)]
    ['.a', '.b']
    >>> [is_deferred_fake(x) for _, x in inner_tensors(t)]
    [True, True]
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from deferinit.fake.tensor import FakeTensor

from .binding import is_deferred_fake


def is_wrapper(t) -> bool:
    """Whether ``t`` is a traceable wrapper subclass of someone else's (not a fake).

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> is_wrapper(TwoTensor(torch.zeros(1), torch.zeros(1))), is_wrapper(torch.zeros(1))
        (True, False)
    """
    return not isinstance(t, FakeTensor) and is_traceable_wrapper_subclass(t)


def inner_tensors(t: torch.Tensor, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for the plain tensors inside wrapper ``t``, nested
    wrappers walked through (``.tensor_impl.qdata``); ``[]`` for anything else.

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> inner = TwoTensor(torch.zeros(1), torch.ones(1))
        >>> [p for p, _ in inner_tensors(TwoTensor(inner, inner))]
        ['.a.a', '.a.b', '.b.a', '.b.b']
    """
    if not is_wrapper(t):
        return []
    found = []
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        path = f"{prefix}.{name}"
        if is_wrapper(inner):
            found.extend(inner_tensors(inner, path))
        elif isinstance(inner, torch.Tensor):  # not a DTensor's device_mesh
            found.append((path, inner))
    return found


def deferred_fakes_of(t, name: str) -> list:
    """``(label, fake)`` for the deferred fakes behind ``t``: itself, or those
    inside a wrapper subclass, labelled ``name`` plus their path.

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> from deferinit import deferred
        >>> with deferred():
        ...     t = TwoTensor(torch.zeros(2), torch.ones(2))
        >>> [label for label, _ in deferred_fakes_of(t, "w")]
        ['w.a', 'w.b']
    """
    if is_deferred_fake(t):
        return [(name, t)]
    return [(name + path, x) for path, x in inner_tensors(t) if is_deferred_fake(x)]


def wrapper_layers(t: torch.Tensor) -> list[torch.Tensor]:
    """The wrappers ``t`` is made of, innermost first and ``t`` last: the order
    in which they are rebuilt around real inner tensors.

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> inner = TwoTensor(torch.zeros(1), torch.ones(1))
        >>> outer = TwoTensor(inner, inner)
        >>> [w is outer for w in wrapper_layers(outer)]
        [False, True]
    """
    if not is_wrapper(t):
        return []
    layers: list = []
    _layers(t, layers, set())
    return layers


def _layers(w, layers: list, seen: set) -> None:
    # A function of the module, not a closure: a recursive closure is a
    # reference cycle, garbage only the cyclic collector frees (one per
    # tensor materialized).
    if id(w) in seen:
        return
    seen.add(id(w))
    names, _ = w.__tensor_flatten__()
    for name in names:
        inner = getattr(w, name)
        if is_wrapper(inner):
            _layers(inner, layers, seen)
    layers.append(w)


def deferred_inside(t) -> bool:
    """Whether a deferred fake is inside wrapper ``t`` (see :func:`inner_tensors`).

    Example::

        >>> from torch.testing._internal.two_tensor import TwoTensor
        >>> deferred_inside(TwoTensor(torch.zeros(1), torch.ones(1)))
        False
    """
    return any(is_deferred_fake(x) for _, x in inner_tensors(t))
