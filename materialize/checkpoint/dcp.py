"""PyTorch distributed checkpoints (``torch.distributed.checkpoint``) as a checkpoint source.

A directory written by ``dcp.save`` (``FileSystemWriter``) holds a
``.metadata`` file and ``__<rank>_<n>.distcp`` files.  The metadata lists,
for every tensor, its dtype, its size and its *chunks* (the blocks each
saving rank held: offsets and sizes), and where each chunk is stored
(:mod:`.dcp_metadata`); each chunk is a ``torch.save`` archive inside a
``.distcp`` file, read as ``dcp.load`` reads it (``torch.load`` of the
file's stretch), by the reader of every archive (:mod:`.archive`): nothing
but its header.  Opening the directory reads and checks the whole metadata;
a chunk's header (its layout) is read and checked once, when a load first
needs it: ``load_checkpoint`` reads, after the module's walk, those of the
chunks its loads meet (a rank loading after sharding, its own blocks'
chunks only, never the other ranks', as ``dcp.load``'s plan reads only the
chunks its state dict meets; a whole tensor, all of its chunks), so that
they are refused there with :class:`CheckpointError`; a read while
materializing that meets a chunk not read yet reads it then, refused with
:class:`CheckpointReadError` as a file cut short is.

:class:`DcpCheckpoint` is a :class:`~.files.Source`: each tensor is an
:class:`Entry` whose element space is the whole tensor in row-major order,
as for a safetensors file: loads, shards and the parts replay asks for are
described in it the same way.  Reading a part (a block of rows, a column
block, what a rank keeps) finds the chunks it meets and reads from each
only the elements inside the part, straight into the destination: a rank
reads about its own bytes whatever the number of ranks that saved the
checkpoint (``dcp.load`` reshards the same way, one whole chunk at a time).

Example::

    >>> import torch.distributed.checkpoint as dcp
    >>> dcp.save(model.state_dict(), checkpoint_id="/ckpt/step-100")
    >>> entries = open_dcp("/ckpt/step-100")
    >>> entries["layers.0.w"]
    <Entry 'layers.0.w' of the distributed checkpoint /ckpt/step-100 [4096, 4096] float32>
"""

from __future__ import annotations

import io
import math
import os
from typing import NamedTuple

import torch

from deferinit.ir.boxes import as_box, intersect, slab

from .errors import CheckpointError
from .archive import ArchiveError, Record, layout, read_archive
from .copying import copy_strided
from .dcp_metadata import METADATA, read_metadata, tensors
from .entries import Entry, contiguous_strides
from .errors import CheckpointReadError
from .files import _NOTHING_CHANGED, Source, Window, identity, open_regular, record_reader


def is_dcp_directory(path: str) -> bool:
    """Whether ``path`` is a distributed checkpoint (it has a ``.metadata`` file,
    or only the per-rank ``__<rank>.metadata`` files of a save without collectives)."""
    if os.path.lexists(os.path.join(path, METADATA)):
        return True
    try:
        return any(n.startswith("__") and n.endswith(METADATA) for n in os.listdir(path))
    except OSError:
        return False


def open_dcp(path: str) -> dict:
    """``key -> Entry`` of the distributed checkpoint directory ``path``."""
    return DcpCheckpoint(path).open()


class ChunkLayout(NamedTuple):
    """Where a chunk's elements are: its record in the archive at ``[start, start +
    length)`` of its file; the chunk is ``offset``, ``sizes``, ``strides`` in it."""

    dtype: torch.dtype
    record: Record
    offset: int
    sizes: tuple
    strides: tuple
    start: int
    length: int


def chunk_layout(f, start: int, length: int, what: str) -> ChunkLayout:
    """The layout of the one tensor ``torch.save``\\ d at ``[start, start + length)``
    of the open file ``f``; :class:`ArchiveError` for anything else."""
    window = Window(f.fileno(), start, length)
    # A small archive (PyTorch's reader reads its last 4 KiB anyway) is read at once.
    obj, records = read_archive(io.BytesIO(window.read()) if length <= 8192 else window)
    if type(obj) not in (torch.Tensor, torch.nn.Parameter):
        raise ArchiveError(f"it holds a {type(obj).__name__}, not one tensor")
    record, offset, strides = layout(obj, records, what)
    return ChunkLayout(obj.dtype, record, offset, tuple(obj.shape), tuple(strides), start, length)


def _read_layouts(path: str, wanted: dict, layouts: dict, identities: dict) -> dict:
    """``key -> {i: ChunkLayout}`` of the chunks ``wanted`` (``key -> indices``;
    ``layouts``: what the metadata says of each key), each checked against the
    metadata, each file opened once; the files noted in ``identities``."""
    by_file: dict = {}
    for key, indices in wanted.items():
        for i in indices:
            by_file.setdefault(layouts[key][2][i].file, []).append((key, i))
    found: dict = {}
    for name, items in by_file.items():
        full = os.path.join(path, name)
        with open_regular(full) as f:
            identities[full] = identity(f)
            for key, i in items:
                dtype, chunk = layouts[key][0], layouts[key][2][i]
                what = f"{key!r} of {path}: the chunk at bytes {chunk.start}..{chunk.start + chunk.length} of {full}"
                try:
                    lay = chunk_layout(f, chunk.start, chunk.length, "its tensor")
                except ArchiveError as e:
                    raise CheckpointError(f"{what} is not a torch.save archive torch.load reads: {e}.") from None
                if lay.dtype != dtype or lay.sizes != chunk.sizes:
                    raise CheckpointError(
                        f"{what} holds {list(lay.sizes)} {lay.dtype}, the metadata says {list(chunk.sizes)} {dtype}."
                    )
                found.setdefault(key, {})[i] = lay
    return found


def _ReadError(message: str) -> CheckpointReadError:
    """A chunk first read while materializing: refused as a file cut short is."""
    return CheckpointReadError(f"{message}{_NOTHING_CHANGED}")


class DcpCheckpoint(Source):
    """One checkpoint directory: its tensors' layouts, and the identity of its files."""

    what = "not a distributed checkpoint load_checkpoint reads"

    def __init__(self, path: str):
        super().__init__(path)
        self.chunks: dict = {}  # key -> {chunk's index: ChunkLayout}: the chunks whose layout was read
        if not os.path.lexists(os.path.join(self.path, METADATA)):
            raise CheckpointError(
                f"{self.path} has per-rank metadata files (__<rank>.metadata, a save without "
                "collectives) and no .metadata: each describes one rank's shards only. Load it "
                "with torch.distributed.checkpoint.load on the same ranks, or save with a process group."
            )

    def describe(self) -> str:
        return f"the distributed checkpoint {self.path}"

    def files(self, key: str) -> list:
        chunks = self.layouts[key][2]
        return [os.path.join(self.path, METADATA)] + sorted(
            {os.path.join(self.path, chunks[i].file) for i in self.chunks.get(key, ())})

    def _parse(self, identities: dict) -> dict:
        identities[os.path.join(self.path, METADATA)] = identity(os.path.join(self.path, METADATA))
        meta = read_metadata(self.path)
        save_id = getattr(vars(meta).get("storage_meta"), "save_id", None)
        save_id = save_id if isinstance(save_id, str) else None
        return {
            key: (Entry(self, key, info.dtype, info.shape, 0, 0, contiguous_strides(info.shape)),
                  (info.dtype, info.shape, tuple(info.chunks), save_id))
            for key, info in tensors(meta, self.path).items()
        }

    def need(self, entries) -> None:
        """Read the layout of every chunk the elements of ``entries`` meet (a rank's
        blocks meet its own chunks only: the other ranks' are never opened)."""
        wanted: dict = {}
        for entry in entries:
            _, shape, chunks, _ = self.layouts[entry.key]
            if entry.shape == shape and entry.offset == 0 and entry.strides == contiguous_strides(shape):
                wanted.setdefault(entry.key, set()).update(range(len(chunks)))  # the whole tensor
            elif math.prod(entry.shape):
                box = as_box(entry.offset, entry.shape, entry.strides, shape) or slab(
                    entry.offset, entry.shape, entry.strides, shape)
                wanted.setdefault(entry.key, set()).update(self._meeting(entry.key, box))
        self._read(wanted, CheckpointError)

    def _meeting(self, key: str, box) -> list:
        return [i for i, c in enumerate(self.layouts[key][2]) if intersect(*box, c.offsets, c.sizes) is not None]

    def _read(self, wanted: dict, error) -> None:
        """Read the layouts of the chunks ``wanted`` (``key -> indices``) not read yet."""
        missing = {key: sorted(set(indices) - self.chunks.get(key, {}).keys()) for key, indices in wanted.items()}
        missing = {key: indices for key, indices in missing.items() if indices}
        if not missing:
            return
        identities: dict = {}
        found = self.reading(error, _read_layouts, self.path, missing, self.layouts, identities)
        for name, ident in identities.items():
            self.identities.setdefault(name, ident)  # a file changed since another key's read: check() sees it
        for key, layouts in found.items():
            self.chunks[key] = {**self.chunks.get(key, {}), **layouts}

    def _chunk_layouts(self, key: str, box) -> list:
        """``(chunk, ChunkLayout)`` of each chunk of ``key`` meeting ``box``; a layout
        not read by :meth:`need` is read now (a read while materializing)."""
        meets = self._meeting(key, box)
        self._read({key: meets}, _ReadError)
        chunks, known = self.layouts[key][2], self.chunks.get(key, {})
        return [(chunks[i], known[i]) for i in meets]

    def _reparse(self, key: str) -> tuple:
        """The metadata, and the chunks of ``key`` read so far, read again."""
        now, identities = super()._reparse(key)
        if now != self.layouts[key]:
            return None, identities
        read = {key: sorted(self.chunks.get(key, ()))}
        again = self.reading(CheckpointReadError, _read_layouts, self.path, read, {key: now}, identities)
        return (now, again.get(key, {})), identities

    def _layout(self, key: str):
        return self.layouts[key], self.chunks.get(key, {})

    def copy(self, entry, offset, sizes, strides, dst, via=None) -> int:
        """Read the elements ``offset + i . strides`` of the tensor into ``dst``."""
        dtype, shape, _, _ = self.layouts[entry.key]
        sizes = tuple(sizes)
        if math.prod(sizes) == 0:
            return 0
        box = as_box(offset, sizes, strides, shape)
        if box is not None:
            target = _viewed(dst, box[1])
            if target is not None:
                return self._read_box(box, target, via, entry)
        # Not a block of the tensor (a transposed piece, a run across rows), or
        # ``dst`` cannot take the block's shape: read the stretch it lies in.
        start, box_sizes = box if box is not None else slab(offset, sizes, strides, shape)
        buffer = torch.empty(box_sizes, dtype=dtype if via is None else via)
        done = self._read_box((start, box_sizes), buffer, via, entry)
        if box is not None:
            piece = buffer.reshape(sizes)
        else:
            first = sum(i * s for i, s in zip(start, contiguous_strides(shape)))
            piece = buffer.as_strided(sizes, strides, offset - first)
        with torch.no_grad():
            dst.copy_(piece)
        return done

    def _read_box(self, box, dst, via, entry) -> int:
        start, sizes = box
        work: dict = {}
        for chunk, lay in self._chunk_layouts(entry.key, box):
            work.setdefault(chunk.file, []).append((chunk, lay, intersect(start, sizes, chunk.offsets, chunk.sizes)))
        done = 0
        for name, items in work.items():
            full = os.path.join(self.path, name)
            with self.open_checked(full, entry) as f:
                fd = f.fileno()
                for chunk, lay, (at, extent) in items:
                    view = dst
                    for d, (i, n) in enumerate(zip(at, extent)):
                        view = view.narrow(d, i - start[d], n)
                    first = lay.offset + sum((i - o) * s for i, o, s in zip(at, chunk.offsets, lay.strides))
                    read = record_reader(lay.record, entry, fd, lay.start, lay.length)
                    base = lay.start + lay.record.position if lay.record.position is not None else 0
                    done += copy_strided(read, base, lay.dtype, first, extent, lay.strides, view, via)
                self.still(full, fd, entry)
        return done


def _viewed(dst: torch.Tensor, box_sizes):
    """``dst`` with the block's shape (the same elements in the same order), or None."""
    if tuple(dst.shape) == tuple(box_sizes):
        return dst
    try:
        return dst.view(box_sizes)
    except RuntimeError:
        return None
