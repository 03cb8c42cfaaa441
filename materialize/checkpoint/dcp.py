"""PyTorch distributed checkpoints (``torch.distributed.checkpoint``) as a checkpoint source.

A directory written by ``dcp.save`` (``FileSystemWriter``) holds a
``.metadata`` file and ``__<rank>_<n>.distcp`` files.  The metadata lists,
for every tensor, its dtype, its size and its *chunks* (the blocks each
saving rank held: offsets and sizes), and where each chunk is stored
(:mod:`.dcp_metadata`); each chunk is a ``torch.save`` archive inside a
``.distcp`` file (:mod:`.dcp_chunks`).  Opening the directory reads the
metadata and every chunk's archive header, nothing else.

Each tensor becomes an :class:`Entry` over a :class:`DcpTensor`, whose
element space is the whole tensor in row-major order, as for a
safetensors file: loads, shards and the parts replay asks for are
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

import math
import os

import torch

from deferinit.boxes import as_box, intersect, slab
from deferinit.errors import CheckpointError, CheckpointNotFoundError, CheckpointReadError

from .dcp_chunks import chunk_layout, read_into
from .dcp_metadata import METADATA, read_metadata, tensors
from .entries import Entry, contiguous_strides
from .files import open_to_read


def is_dcp_directory(path: str) -> bool:
    """Whether ``path`` is a distributed checkpoint (it has a ``.metadata`` file,
    or only the per-rank ``__<rank>.metadata`` files of a save without collectives)."""
    if os.path.isfile(os.path.join(path, METADATA)):
        return True
    try:
        return any(n.startswith("__") and n.endswith(METADATA) for n in os.listdir(path))
    except OSError:
        return False


def open_dcp(path: str) -> dict:
    """``key -> Entry`` of the distributed checkpoint directory ``path``."""
    return DcpCheckpoint(path).entries()


def _identity(path: str) -> tuple:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class DcpCheckpoint:
    """One checkpoint directory: its tensors' layouts, and the identity of its files."""

    def __init__(self, path: str):
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.isfile(os.path.join(self.path, METADATA)):
            raise CheckpointError(
                f"{self.path} has per-rank metadata files (__<rank>.metadata, a save without "
                "collectives) and no .metadata: each describes one rank's shards only. Load it "
                "with torch.distributed.checkpoint.load on the same ranks, or save with a process group."
            )
        self.layouts, self.identities, self.save_id = self._parse(CheckpointError)

    def _parse(self, error):
        try:
            identities = {METADATA: _identity(os.path.join(self.path, METADATA))}
            meta = read_metadata(self.path)
            infos = tensors(meta, self.path)
        except CheckpointError as e:
            if error is CheckpointError and isinstance(e, CheckpointNotFoundError):
                raise
            raise error(str(e)) from None
        except OSError as e:
            raise error(f"cannot read {self.path}: {e.strerror or e}") from None
        layouts = {}
        by_file: dict = {}
        for key, info in infos.items():
            for i, chunk in enumerate(info.chunks):
                by_file.setdefault(chunk.file, []).append((key, i, chunk))
            layouts[key] = [info.dtype, info.shape, [None] * len(info.chunks), info.chunks]
        for name, items in by_file.items():
            full = os.path.join(self.path, name)
            try:
                fd = os.open(full, os.O_RDONLY)
            except OSError as e:
                raise error(f"cannot read {full}: {e.strerror or e}") from None
            try:
                identities[name] = _identity(full)
                for key, i, chunk in items:
                    what = f"{key!r} of {self.path}"
                    try:
                        layout = chunk_layout(fd, full, chunk.start, chunk.length, what)
                    except CheckpointError as e:
                        raise error(str(e)) from None
                    dtype = layouts[key][0]
                    if layout.dtype != dtype or layout.sizes != chunk.sizes:
                        raise error(
                            f"{what}: the chunk at {list(chunk.offsets)} holds {list(layout.sizes)} "
                            f"{layout.dtype}, the metadata says {list(chunk.sizes)} {dtype}."
                        )
                    layouts[key][2][i] = layout
            finally:
                os.close(fd)
        layouts = {key: (dtype, shape, tuple(zip(chunks, found))) for key, (dtype, shape, found, chunks) in layouts.items()}
        save_id = getattr(getattr(meta, "storage_meta", None), "save_id", None)
        return layouts, identities, save_id if isinstance(save_id, str) else None

    def entries(self) -> dict:
        out = {}
        for key, (dtype, shape, _) in self.layouts.items():
            out[key] = Entry(DcpTensor(self, key), key, dtype, shape, 0, 0, contiguous_strides(shape))
        return out

    def describe(self) -> str:
        return f"the distributed checkpoint {self.path}"

    def check(self, key: str) -> None:
        """The files ``key`` is read from are still those opened, or say the same about it."""
        names = {METADATA} | {chunk.file for chunk, _ in self.layouts[key][2]}
        try:
            same = all(_identity(os.path.join(self.path, n)) == self.identities.get(n) for n in names)
        except OSError as e:
            raise CheckpointReadError(
                f"cannot read {key!r} of {self.describe()}: {e.strerror or e} (it was there when "
                "load_checkpoint read its metadata). Nothing was changed; the tensors stay deferred."
            ) from None
        if same:
            return
        try:
            layouts, identities, save_id = self._parse(CheckpointReadError)
        except CheckpointReadError as e:
            raise CheckpointReadError(
                f"{e} It changed since load_checkpoint read it. Nothing was changed; the tensors stay deferred."
            ) from None
        if layouts.get(key) != self.layouts[key] or save_id != self.save_id:
            # Another save over the same directory has another save_id, even
            # with every chunk where it was.
            raise CheckpointReadError(
                f"{self.describe()} changed since load_checkpoint read it: {key!r} is no longer stored "
                "as it was, or another save replaced it. Call load_checkpoint again. Nothing was "
                "changed; the tensors stay deferred."
            )
        self.identities.update(identities)


class DcpTensor:
    """One tensor of a distributed checkpoint, the source of its :class:`Entry`:
    reads any part of it from the chunks that hold that part."""

    def __init__(self, checkpoint: DcpCheckpoint, key: str):
        self.checkpoint = checkpoint
        self.key = key

    def describe(self) -> str:
        return self.checkpoint.describe()

    def check(self, entry) -> None:
        self.checkpoint.check(self.key)

    def copy(self, entry, offset, sizes, strides, dst, via=None) -> int:
        """Read the elements ``offset + i . strides`` of the tensor into ``dst``."""
        dtype, shape, chunks = self.checkpoint.layouts[self.key]
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
        _, _, chunks = self.checkpoint.layouts[self.key]
        work: dict = {}
        for chunk, layout in chunks:
            common = intersect(start, sizes, chunk.offsets, chunk.sizes)
            if common is not None:
                work.setdefault(chunk.file, []).append((chunk, layout, common))
        done = 0
        for name, items in work.items():
            full = os.path.join(self.checkpoint.path, name)
            fd = open_to_read(full, entry)
            try:
                for chunk, layout, (at, extent) in items:
                    view = dst
                    for d, (i, n) in enumerate(zip(at, extent)):
                        view = view.narrow(d, i - start[d], n)
                    inside = tuple(i - o for i, o in zip(at, chunk.offsets))
                    done += read_into(fd, full, layout, inside, extent, view, via)
            except EOFError as e:
                raise CheckpointReadError(
                    f"cannot read {entry.describe()}: {e} (the file is truncated). Nothing was changed; "
                    "the tensors stay deferred."
                ) from None
            finally:
                os.close(fd)
        return done


def _viewed(dst: torch.Tensor, box_sizes):
    """``dst`` with the block's shape (the same elements in the same order), or None."""
    if tuple(dst.shape) == tuple(box_sizes):
        return dst
    try:
        return dst.view(box_sizes)
    except RuntimeError:
        return None
