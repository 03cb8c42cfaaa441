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

import torch

from deferinit.ir.boxes import contiguous_strides  # noqa: F401 (re-exported)

from .errors import CheckpointError, CheckpointReadError


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

    def box(self, start, sizes) -> "Entry":
        """The block of this tensor starting at index ``start``, of shape ``sizes``."""
        offset = self.offset + sum(i * s for i, s in zip(start, self.strides))
        return Entry(self.source, self.key, self.dtype, sizes, self.base, offset, self.strides)

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

    def kept(self) -> "Entry":
        """This tensor as it is now, for a load read later (see :meth:`MemorySource.kept`)."""
        return self.source.kept(self)

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


def read_now(entry: Entry, dst: torch.Tensor) -> None:
    """Read ``entry`` into ``dst`` within a ``load_checkpoint`` call: a failed read
    (an I/O error, a file cut short since its header was read) is a
    :class:`CheckpointError` there, before any tensor of the module is written."""
    try:
        with torch.no_grad():
            entry.read_parts(dst)
    except (CheckpointReadError, OSError) as e:
        if isinstance(e, CheckpointReadError):
            reason = str(e).split(" Nothing was changed")[0]
        else:
            reason = f"{e.strerror or e}."
        raise CheckpointError(
            f"cannot load {entry.describe()}: {reason} Nothing was loaded: every tensor of the module is as it was."
        ) from None


class MemorySource:
    """A tensor in memory (a state dict's value).

    ``load_checkpoint`` behaves as if it copied the tensor at the call.  Real
    tensors are loaded within the call; for a deferred one, :meth:`kept`
    decides what to keep until materialization: a tensor whose changes its
    version counter shows is kept by reference (an alias of its memory, so
    that ``.data = other`` later leaves the load's values alone), and an
    in-place change since raises :class:`CheckpointReadError` then; an
    inference tensor, which has no version counter, is copied at the call.

    Example::

        >>> t = torch.ones(2)
        >>> kept = MemorySource.entry("w", t).kept()
        >>> t.data = torch.zeros(2)            # the load still reads the ones
        >>> out = torch.empty(2); kept.read_parts(out); out.tolist()
        [1.0, 1.0]
    """

    def __init__(self, tensor: torch.Tensor, version=None, storage=None):
        self.tensor = tensor
        self.version = version
        # The memory read: the tensor's at the call (it keeps it if ``.data`` is reassigned).
        self.storage = storage

    @staticmethod
    def entry(key: str, tensor: torch.Tensor) -> Entry:
        return Entry(MemorySource(tensor), key, tensor.dtype, tensor.shape, 0, tensor.storage_offset(), tensor.stride())

    def kept(self, entry) -> Entry:
        """``entry`` as it is now, to be read at materialization (see the class)."""
        with torch.no_grad():
            t = self.tensor
            if t.is_inference():
                with torch.inference_mode(False):
                    copy = self.view(entry).clone()
                return Entry(MemorySource(copy), entry.key, copy.dtype, copy.shape, 0, 0, copy.stride())
        # Not t.detach(): made inside a dispatch mode's handler (the walk of
        # .capture), a detached alias gets a version counter of its own.
        kept = MemorySource(t, t._version, t.untyped_storage())
        return Entry(kept, entry.key, entry.dtype, entry.shape, 0, entry.offset, entry.strides)

    def view(self, entry) -> torch.Tensor:
        """The elements of ``entry``, as a tensor on this memory."""
        return self._on_memory(entry.offset, entry.shape, entry.strides)

    def _on_memory(self, offset, sizes, strides) -> torch.Tensor:
        t = self.tensor
        with torch.no_grad():
            out = torch.empty(0, dtype=t.dtype, device=t.device).set_(self._memory(), offset, tuple(sizes), tuple(strides))
            # A lazy conjugate or negative view (x.conj()) reads as its values, as copy_ reads it.
            if t.is_conj():
                out = out.conj()
            if t.is_neg():
                out = torch._neg_view(out)
            return out

    def _memory(self):
        return self.storage if self.storage is not None else self.tensor.untyped_storage()

    def memory_key(self) -> tuple:
        """What identifies the memory read, as :func:`~.capture.storage_key` does."""
        return (self.tensor.device.type, self._memory()._cdata)

    def copy(self, entry, offset, sizes, strides, dst, via=None) -> None:
        src = self._on_memory(offset, sizes, strides)
        with torch.no_grad():
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

