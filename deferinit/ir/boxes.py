"""Blocks of a contiguous tensor: which strided element sets are boxes of its indices.

A piece of a tensor is described in two ways here.  The liveness pass and
checkpoint loads speak of *elements*: ``offset + sum(i_k * strides[k])``
for every index ``i`` of ``sizes``, counted in the tensor's own row-major
layout (a shard's rows, a column block, a flattened range).  A sharded
checkpoint (PyTorch's distributed checkpoint) and a DTensor speak of
*boxes*: a start index and sizes per dimension of the tensor.
:func:`as_box` turns the first into the second when it is one (in the same
order of elements), :func:`slab` gives the smallest box a piece lies in
when it is not, and :func:`intersect` cuts one box by another.

Example::

    >>> as_box(4, (2, 2), (4, 1), (3, 4))       # rows 1-2, columns 0-1 of a [3, 4] tensor
    ((1, 0), (2, 2))
    >>> as_box(2, (4,), (1,), (3, 4)) is None   # elements 2..5 wrap a row: no box
    True
    >>> slab(2, (4,), (1,), (3, 4))
    ((0, 0), (2, 4))
"""

from __future__ import annotations

from deferinit.fake.extent import extent


def contiguous_strides(shape) -> tuple:
    strides = []
    step = 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def unravel(flat: int, shape) -> tuple:
    """The index of element ``flat`` of a row-major tensor of ``shape``."""
    index = []
    for n in reversed(tuple(shape)):
        if n:
            flat, i = divmod(flat, n)
        else:
            i = 0
        index.append(i)
    return tuple(reversed(index))


def as_box(offset: int, sizes, strides, shape, layout=None):
    """``(start, box_sizes)`` when the elements ``offset + i . strides`` of a
    tensor of ``shape`` are exactly a box of its indices, enumerated in the
    box's own row-major order (so that a tensor of ``sizes`` holding them
    reshapes to ``box_sizes``); None otherwise.  The tensor is row-major, or
    has the strides ``layout`` (decreasing, its elements not overlapping: a
    column block of a bigger tensor).  An empty piece gives a box with a zero size."""
    shape = tuple(shape)
    if any(n == 0 for n in sizes):
        return (0,) * len(shape), (0,) * len(shape)
    full = contiguous_strides(shape) if layout is None else tuple(layout)
    if layout is not None and not _ordered(shape, full):
        return None
    start = _position(offset, shape, full)
    if start is None or any(s < 0 for s in strides):
        return None
    box = [1] * len(shape)
    d = len(shape) - 1
    for n, s in reversed([(n, s) for n, s in zip(sizes, strides) if n != 1]):
        while d >= 0 and (shape[d] == 1 or full[d] != s):
            d -= 1
        if d < 0:
            return None
        left = n
        while True:
            if left <= shape[d] - start[d]:
                box[d] = left
                d -= 1
                break
            # The piece runs past this dimension: only whole rows of it, of a
            # dimension adjacent in memory to the next one out, merge into it.
            if start[d] != 0 or left % shape[d] != 0 or d == 0 or full[d - 1] != shape[d] * full[d]:
                return None
            box[d] = shape[d]
            left //= shape[d]
            d -= 1
    return start, tuple(box)


def _position(offset: int, shape, strides):
    """The index of the element at ``offset`` of a tensor with decreasing
    ``strides`` whose elements do not overlap, or None if no element is there."""
    index = []
    for n, s in zip(shape, strides):
        if n == 1:
            index.append(0)
            continue
        i = offset // s if s else 0
        if i >= n:
            return None
        index.append(i)
        offset -= i * s
    if offset != 0:
        return None
    return tuple(index)


def _ordered(shape, strides) -> bool:
    """Strides decreasing, each dimension's elements beyond the extent of the ones inside it."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    return all(outer >= n * inner for (_, outer), (n, inner) in zip(dims, dims[1:])) and all(s > 0 for _, s in dims)


def slab(offset: int, sizes, strides, shape):
    """``(start, box_sizes)``: the smallest box holding the elements
    ``offset + i . strides`` that is whole in every dimension after the first
    one it spans (so its elements are one stretch of the row-major layout)."""
    shape = tuple(shape)
    last = extent(sizes, strides, offset) - 1
    lo, hi = unravel(offset, shape), unravel(last, shape)
    start, box = [], []
    spanning = False
    for d, n in enumerate(shape):
        if spanning:
            start.append(0)
            box.append(n)
        elif lo[d] == hi[d]:
            start.append(lo[d])
            box.append(1)
        else:
            spanning = True
            start.append(lo[d])
            box.append(hi[d] - lo[d] + 1)
    return tuple(start), tuple(box)


def intersect(a_start, a_sizes, b_start, b_sizes):
    """``(start, sizes)`` of the common part of two boxes, or None when they share nothing."""
    start, sizes = [], []
    for a0, an, b0, bn in zip(a_start, a_sizes, b_start, b_sizes):
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if hi <= lo:
            return None
        start.append(lo)
        sizes.append(hi - lo)
    return tuple(start), tuple(sizes)
