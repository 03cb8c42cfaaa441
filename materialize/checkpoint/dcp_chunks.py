"""One chunk of a distributed checkpoint: a ``torch.save`` archive inside a ``.distcp`` file.

``dcp.save`` (``FileSystemWriter``) writes every chunk of every tensor with
``torch.save`` into a stretch of a ``.distcp`` file, and records the
stretch (``_StorageInfo``: file, offset, length) in the checkpoint's
metadata.  ``FileSystemReader.read_data`` then ``torch.load``\\ s each whole
chunk into new memory and copies the part it needs.  Here the archive is
only *looked at*: its zip directory (Python's ``zipfile``, on a window of
the file), its local headers, its ``version`` and ``byteorder`` records and its pickle
(unpickled by :class:`_TensorUnpickler`, which knows the few callables a
tensor's pickle names and calls none of them), to learn where the tensor's
elements lie in the file.  Every field is checked against the others and
against the window: sizes, offsets, the storage record's length against
what the pickle says, compression (none), byte order (little), and what
PyTorch's own reader requires of the whole archive (:mod:`.zipcheck`).  The bytes
are then read with ``pread`` straight into the destination
(:func:`read_into`), only the elements asked for.

Example::

    >>> layout = chunk_layout(fd, path, info.offset, info.length, "'w' of /ckpt")
    >>> layout.dtype, layout.sizes, layout.strides
    (torch.float32, (4, 8), (8, 1))
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import zipfile
from typing import NamedTuple

import torch

from deferinit.errors import CheckpointError

from .copying import copy_strided
from .zipcheck import check_archive, data_start, member

# A tensor's pickle is a few hundred bytes; anything much larger is not one.
_MAX_PICKLE = 1 << 20


class ChunkLayout(NamedTuple):
    """Where a chunk's elements are: byte ``base`` of its file holds element 0
    of its storage; the tensor is ``offset``, ``sizes``, ``strides`` in it."""

    dtype: torch.dtype
    base: int
    offset: int
    sizes: tuple
    strides: tuple


class Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a read-only, seekable file."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        if base + pos < 0:
            raise OSError("seek before the start of the chunk")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        got = os.preadv(self._fd, [memoryview(buffer)[:n]], self._start + self._pos)
        self._pos += got
        return got


class _Storage(NamedTuple):
    key: str
    dtype: torch.dtype
    numel: int


class _Tensor(NamedTuple):
    storage: _Storage
    offset: int
    sizes: tuple
    strides: tuple
    dtype: torch.dtype


def _storage_dtypes() -> dict:
    return {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


def _int(x, what) -> int:
    if type(x) is not int or x < 0:
        raise ValueError(f"{what} is {x!r}, not a non-negative integer")
    return x


def _ints(x, what) -> tuple:
    if not isinstance(x, (tuple, list, torch.Size)):
        raise ValueError(f"{what} is {type(x).__name__}, not a tuple")
    return tuple(_int(n, what) for n in x)


def _rebuild(storage, offset, sizes, strides, *rest, dtype=None):
    if not isinstance(storage, _Storage):
        raise ValueError("the tensor's storage is not a storage record")
    sizes, strides = _ints(sizes, "a size"), _ints(strides, "a stride")
    if len(sizes) != len(strides):
        raise ValueError(f"sizes {sizes} and strides {strides} differ in length")
    return _Tensor(storage, _int(offset, "the storage offset"), sizes, strides, dtype or storage.dtype)


def _rebuild_v3(storage, offset, sizes, strides, requires_grad, hooks, dtype, *rest):
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the tensor's dtype is {dtype!r}")
    return _rebuild(storage, offset, sizes, strides, dtype=dtype)


def _rebuild_parameter(data, *rest):
    return data


class _StorageType(NamedTuple):
    dtype: torch.dtype | None  # None: an UntypedStorage (bytes; the tensor says its dtype)


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles the pickle of one ``torch.save``\\ d tensor into its layout,
    calling nothing the pickle names but stand-ins of its own."""

    def find_class(self, module, name):
        known = {
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild,
            ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch.storage", "UntypedStorage"): _StorageType(None),
            ("torch", "UntypedStorage"): _StorageType(None),
        }
        if (module, name) in known:
            return known[(module, name)]
        if module == "torch" and name in _storage_dtypes():
            return _StorageType(_storage_dtypes()[name])
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a tensor's pickle does not")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _StorageType) or not isinstance(key, str):
            raise pickle.UnpicklingError(f"unknown storage {pid!r}")
        return _Storage(key, kind.dtype or torch.uint8, _int(numel, "the storage size"))


def chunk_layout(fd: int, path: str, start: int, length: int, what: str) -> ChunkLayout:
    """The layout of the single tensor ``torch.save``\\ d at ``[start, start + length)``
    of the open file ``fd`` (``path``); raises :class:`CheckpointError` naming
    ``what`` (the chunk) for anything that is not such an archive."""
    def bad(why):
        return CheckpointError(f"{what}: the chunk at bytes {start}..{start + length} of {path} {why}.")

    window = Window(fd, start, length)
    try:
        archive = zipfile.ZipFile(window)
        infos = check_archive(window, archive, bad)
        prefix = archive.infolist()[0].filename.split("/", 1)[0] + "/"
        if prefix + "data.pkl" not in infos:
            raise bad(f"is not a torch.save archive (no {prefix}data.pkl record)")
        order = infos.get(prefix + "byteorder")
        if order is not None and member(window, order, 16, bad) != b"little":
            raise bad(f"was written with byte order {member(window, order, 16, bad)!r}; only little-endian "
                      "chunks are read (load it with dcp.load on the machine that wrote it)")
        data = member(window, infos[prefix + "data.pkl"], _MAX_PICKLE, bad)
        tensor = _TensorUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - zipfile and pickle raise many kinds for bad bytes
        raise bad(f"is not a readable torch.save archive ({type(e).__name__}: {e})") from None
    if not isinstance(tensor, _Tensor):
        raise bad(f"holds a {type(tensor).__name__}, not one tensor")
    storage = tensor.storage
    record = infos.get(f"{prefix}data/{storage.key}")
    if record is None:
        raise bad(f"has no record for its storage {storage.key!r}")
    nbytes = storage.numel * storage.dtype.itemsize
    if record.file_size != nbytes:
        raise bad(f"has a storage record of {record.file_size} bytes where its pickle says {nbytes}")
    at = data_start(window, record, bad)
    if at + nbytes > length:
        raise bad("has a storage record that runs past the chunk's end")
    itemsize = tensor.dtype.itemsize
    if nbytes % itemsize:
        raise bad(f"has {nbytes} storage bytes, not a whole number of {tensor.dtype} elements")
    if math.prod(tensor.sizes):
        last = tensor.offset + sum((n - 1) * s for n, s in zip(tensor.sizes, tensor.strides))
        if last >= nbytes // itemsize:
            raise bad(f"has a tensor reaching element {last} of a storage of {nbytes // itemsize}")
    return ChunkLayout(tensor.dtype, start + at, tensor.offset, tensor.sizes, tensor.strides)


def read_into(fd: int, path: str, layout: ChunkLayout, start, sizes, dst: torch.Tensor, via=None) -> int:
    """Read the block ``start``/``sizes`` of a chunk (indices in the chunk) into
    ``dst`` (of shape ``sizes``); returns the bytes read."""
    offset = layout.offset + sum(i * s for i, s in zip(start, layout.strides))

    def read(position: int, buffer: memoryview) -> None:
        done = 0
        while done < len(buffer):
            n = os.preadv(fd, [buffer[done : done + (1 << 30)]], position + done)
            if n <= 0:
                raise EOFError(f"{path} ends at byte {position + done}")
            done += n

    return copy_strided(read, layout.base, layout.dtype, offset, sizes, layout.strides, dst, via)
