"""Where a strided tensor ends in its storage: one count, one rule for zero-size tensors.

A strided tensor's element ``i`` lies at ``offset + sum(i_k * stride_k)`` in
its storage.  Strides are never negative in PyTorch, so its last element is
the one at every dimension's last index, and a storage holds the tensor when
it has at least :func:`extent` elements.  Every layer asks this (meta
twins and stand-ins need a storage that holds a view, checkpoint readers a
bound on what a view reaches, the liveness pass the bytes a value covers),
and all of them ask it here.
"""

from __future__ import annotations


def extent(size, stride, offset: int = 0) -> int:
    """Elements from the start of the storage to one past the tensor's last
    element: the smallest storage that holds ``size`` at ``stride`` from
    ``offset``.  Count in bytes by passing byte strides and a byte offset
    (then the last element starts at ``extent(...) - 1``).

    A zero-size tensor (a 0 in ``size``) has no element and fits any
    storage, whatever its offset: its extent is 0.  That is PyTorch's rule
    (``computeStorageNbytes``: ``empty_strided`` gives it an empty storage,
    ``as_strided``/``set_`` accept any storage for it).  Callers wanting its
    place instead (an empty span at ``offset``) ask for that themselves.

    Example::

        >>> extent((4, 3), (3, 1))              # a contiguous [4, 3]
        12
        >>> extent((3,), (3,), offset=1)        # its column 1: elements 1, 4, 7
        8
        >>> extent((5, 2), (0, 1), offset=2)    # overlapping rows (an expand)
        4
        >>> extent((0, 3), (3, 1), offset=7)    # zero-size: no storage needed
        0
    """
    if 0 in size:
        return 0
    return offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))


def extent_of(t) -> int:
    """:func:`extent` of tensor ``t``'s own geometry, in its elements.

    Example::

        >>> extent_of(torch.empty(4, 3, device="meta").t()[1:])
        12
    """
    return extent(t.size(), t.stride(), t.storage_offset())
