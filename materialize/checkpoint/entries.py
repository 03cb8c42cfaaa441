"""A tensor of a checkpoint: where its elements are and how to read any part of them.

An :class:`Entry` is one key of a checkpoint: its dtype and shape, and the
layout of its elements in its *source* (a file, or a tensor in memory): the
byte position of element 0 of that source's element space (``base``), and
the tensor's offset and strides in it.  A piece of the tensor (a shard, the
rows a rank keeps) is an entry too (:meth:`Entry.box`).  Load nodes of the
record hold entries; replay reads them (:meth:`Entry.read_parts`,
:meth:`Entry.read`) after checking that the source is still what
``load_checkpoint`` saw (:meth:`Entry.check`).
"""

from __future__ import annotations

import math

import torch

from deferinit.errors import CheckpointReadError


def contiguous_strides(shape) -> tuple:
    strides = []
    step = 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class Entry:
    """One tensor of a checkpoint source.

    Example::

        >>> e = Entry(MemorySource(torch.arange(12.0).reshape(3, 4)), "w", torch.float32, (3, 4), 0, 0, (4, 1))
        >>> out = torch.empty(2, 4)
        >>> e.box((1, 0), (2, 4)).read_parts(out)
        >>> out[0].tolist()
        [4.0, 5.0, 6.0, 7.0]
    """

    __slots__ = ("source", "key", "dtype", "shape", "base", "offset", "strides")

    def __init__(self, source, key: str, dtype: torch.dtype, shape, base: int, offset: int, strides):
        self.source = source
        self.key = key
        self.dtype = dtype
        self.shape = tuple(shape)
        self.base = base
        self.offset = offset
        self.strides = tuple(strides)

    @property
    def contiguous(self) -> bool:
        """Whether the tensor's elements lie in order in its source (then any part
        of the tensor is read by its position in the tensor)."""
        return all(n == 1 or s == c for n, s, c in zip(self.shape, self.strides, contiguous_strides(self.shape)))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def box(self, start, sizes) -> "Entry":
        """The block of this tensor starting at index ``start``, of shape ``sizes``."""
        offset = self.offset + sum(i * s for i, s in zip(start, self.strides))
        return Entry(self.source, self.key, self.dtype, sizes, self.base, offset, self.strides)

    def first(self) -> "Entry":
        """Element 0 as a 0-dim tensor (``load_state_dict`` loads a shape-[1]
        checkpoint tensor into a 0-dim parameter)."""
        return Entry(self.source, self.key, self.dtype, (), self.base, self.offset, ())

    def read_parts(self, dst: torch.Tensor, parts=None) -> None:
        """Read the tensor into ``dst`` (its shape), or only ``parts``: ``(offset,
        sizes, strides)`` blocks in the elements of a contiguous ``dst``, which
        then sit at the same positions (a contiguous entry only)."""
        if parts is None:
            self.source.copy(self, self.offset, self.shape, self.strides, dst)
            return
        start = dst.storage_offset()
        for offset, sizes, strides in parts:
            view = dst.as_strided(sizes, strides, start + offset)
            self.source.copy(self, self.offset + offset, sizes, strides, view)

    def read(self, dst: torch.Tensor, offset: int, sizes, strides, via=None) -> None:
        """Read the elements ``offset + i . strides`` of this (contiguous) tensor into ``dst``."""
        self.source.copy(self, self.offset + offset, sizes, strides, dst, via)

    def check(self) -> None:
        """Raise :class:`CheckpointReadError` if the source changed since it was opened."""
        self.source.check(self)

    def fingerprint(self) -> bytes:
        """A digest of the values (ranks compare it before a scatter; see :mod:`.fingerprints`)."""
        from .fingerprints import digest

        return digest(self)

    def describe(self) -> str:
        return f"{self.key!r} of {self.source.describe()}"

    def __str__(self) -> str:
        return f"{self.describe()} {list(self.shape)} {str(self.dtype).replace('torch.', '')}"

    def __repr__(self) -> str:
        return f"<Entry {self}>"


class MemorySource:
    """A tensor in memory (a state dict's value), kept by reference with its version."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.version = None if tensor.is_inference() else tensor._version

    @staticmethod
    def entry(key: str, tensor: torch.Tensor) -> Entry:
        return Entry(MemorySource(tensor), key, tensor.dtype, tensor.shape, 0, tensor.storage_offset(), tensor.stride())

    def copy(self, entry, offset, sizes, strides, dst, via=None) -> None:
        t = self.tensor
        with torch.no_grad():
            src = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), offset, tuple(sizes), tuple(strides))
            dst.copy_(src if via is None else src.to(via))

    def check(self, entry) -> None:
        if self.version is not None and self.tensor._version != self.version:
            raise CheckpointReadError(
                f"the tensor given for {entry.key!r} was modified in place since load_checkpoint "
                f"(version {self.version} -> {self.tensor._version}); the load would not read what it "
                "was given. Keep it unchanged until materialization, or pass a clone. Nothing was "
                "changed; the tensors stay deferred."
            )

    def describe(self) -> str:
        return "the state dict"
