"""The bytes of a storage that a tensor covers, for the liveness pass.

A :class:`Region` is the set of bytes a strided view addresses in its
storage: an offset, sizes and strides in bytes, and the width of one
element.  The liveness pass (:mod:`deferinit.ir.liveness`) asks three
questions of regions, and each answer errs on the safe side:

* ``intersects``: whether two regions may share a byte (byte ranges overlap);
* ``covers``: whether one region surely contains another (a dense region, one
  whose elements tile a byte range, contains everything inside that range;
  otherwise only the very same geometry);
* ``minus``: what is left of a region after a write covers part of it (exact
  for two dense regions, otherwise the region itself or nothing).

Example::

    >>> whole = Region(0, (4, 3), (12, 4), 4)          # a contiguous float32 [4, 3]
    >>> rows = Region(12, (2, 3), (12, 4), 4)          # its rows 1 and 2
    >>> whole.covers(rows), rows.covers(whole)
    (True, False)
    >>> [(r.lo, r.hi) for r in whole.minus(rows)]
    [(0, 12), (36, 48)]
"""

from __future__ import annotations

import functools

from deferinit.fake.extent import extent


class Region:
    """Bytes ``offset + sum(i_k * strides[k]) + [0, itemsize)`` for every index ``i``."""

    __slots__ = ("offset", "sizes", "strides", "itemsize", "lo", "hi", "dense")

    def __init__(self, offset: int, sizes, strides, itemsize: int):
        sizes_, strides_ = [], []
        for n, s in zip(sizes, strides):
            if n != 1:
                sizes_.append(n)
                strides_.append(s)
        self.offset = offset
        self.sizes = tuple(sizes_)
        self.strides = tuple(strides_)
        self.itemsize = itemsize
        self.lo = offset
        # In bytes: the last element starts at extent - 1.  No element: nothing past lo.
        self.hi = offset if 0 in sizes_ else extent(sizes_, strides_, offset) - 1 + itemsize
        # Dense: no byte addressed twice, no gap (sorted by stride, each
        # stride is the extent of the dimensions inside it).  Row-major
        # geometry, the usual one, is checked without sorting.
        expected = itemsize
        dense = True
        order = range(len(sizes_) - 1, -1, -1)
        if any(strides_[i] > strides_[i - 1] for i in range(1, len(strides_))):
            order = sorted(range(len(sizes_)), key=strides_.__getitem__)
        for i in order:
            if strides_[i] != expected:
                dense = False
                break
            expected *= sizes_[i]
        self.dense = dense

    @classmethod
    def of(cls, value) -> "Region | None":
        """The region of a recorded value (None when it has no element)."""
        return _region_of(value.offset, value.size, value.stride, value.dtype)

    @classmethod
    def interval(cls, lo: int, hi: int) -> "Region":
        """The bytes ``[lo, hi)``."""
        return cls(lo, (hi - lo,), (1,), 1)

    def intersects(self, other: "Region") -> bool:
        return self.lo < other.hi and other.lo < self.hi

    def same(self, other: "Region") -> bool:
        return (self.offset, self.sizes, self.strides, self.itemsize) == (
            other.offset, other.sizes, other.strides, other.itemsize
        )

    def covers(self, other: "Region") -> bool:
        """Whether every byte of ``other`` is surely in this region."""
        if self.dense:
            return self.lo <= other.lo and other.hi <= self.hi
        return self.same(other)

    def minus(self, other: "Region") -> list["Region"]:
        """What is left of this region once ``other`` is written (a superset of it)."""
        if not self.intersects(other):
            return [self]
        if other.covers(self):
            return []
        if self.dense and other.dense:
            left = []
            if self.lo < other.lo:
                left.append(Region.interval(self.lo, other.lo))
            if other.hi < self.hi:
                left.append(Region.interval(other.hi, self.hi))
            return left
        return [self]

    def in_elements(self, itemsize: int, origin: int):
        """``(offset, sizes, strides)`` in elements of ``itemsize`` bytes counted from
        byte ``origin`` (the same set of bytes; a dense region as one run), or None
        when the region does not fall on whole such elements."""
        if self.lo < origin:
            return None
        if self.dense:
            if (self.lo - origin) % itemsize or (self.hi - self.lo) % itemsize:
                return None
            return ((self.lo - origin) // itemsize, ((self.hi - self.lo) // itemsize,), (1,))
        if self.itemsize != itemsize or (self.offset - origin) % itemsize or any(s % itemsize for s in self.strides):
            return None
        return ((self.offset - origin) // itemsize, self.sizes, tuple(s // itemsize for s in self.strides))

    def __repr__(self) -> str:
        return f"<Region [{self.lo}, {self.hi}) sizes={list(self.sizes)} strides={list(self.strides)}{' dense' if self.dense else ''}>"


# Regions are never changed once made, and a model repeats few geometries:
# one Region per geometry, not one per value per pass (the liveness pass
# and the allocations ask for every value's region; 50,000 small tensors).
@functools.lru_cache(maxsize=4096)
def _region_of(offset: int, size: tuple, stride: tuple, dtype) -> "Region | None":
    for n in size:
        if n == 0:
            return None
    width = dtype.itemsize
    return Region(offset * width, size, tuple(s * width for s in stride), width)
