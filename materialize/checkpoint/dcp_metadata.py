"""The ``.metadata`` file of a distributed checkpoint, read without running it.

``FileSystemReader.read_metadata`` unpickles ``.metadata`` with
``pickle.load``, which calls whatever the file names.  Here the same file
becomes the same objects (PyTorch's own ``Metadata``,
``TensorStorageMetadata``, ``ChunkStorageMetadata``, ``MetadataIndex``,
``_StorageInfo``...) through an unpickler that builds only those classes
and a few harmless values (``torch.Size``, dtypes, layouts, paths); a
file that names anything else is refused (a custom planner's own classes
in ``planner_data`` too: ``dcp.load`` would import and call them).
:func:`tensors` then checks every field a load reads, as
untrusted input: types, shapes, chunks inside their tensor, not
overlapping and covering it, a storage record for each chunk, its file a
plain name inside the checkpoint directory.

Example::

    >>> meta = read_metadata("/ckpt/step-100")        # PyTorch's Metadata object
    >>> tensors(meta, "/ckpt/step-100")["layers.0.w"].chunks[0].offsets
    (0, 0)
"""

from __future__ import annotations

import errno
import math
import os
import pathlib
import pickle
from typing import NamedTuple

import torch

from deferinit.boxes import intersect
from deferinit.errors import CheckpointError, CheckpointNotFoundError

METADATA = ".metadata"  # torch.distributed.checkpoint.filesystem._metadata_fn


def _known() -> dict:
    from torch.distributed.checkpoint import filesystem, metadata

    known = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): _layout,
        ("collections", "OrderedDict"): dict,
        ("pathlib", "PosixPath"): pathlib.PurePosixPath,
        ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
    }
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
                 "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex", "StorageMeta"):
        known[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    return known


def _layout(name):
    layouts = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}
    if name not in layouts:
        raise pickle.UnpicklingError(f"unknown layout {name!r}")
    return layouts[name]


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file):
        super().__init__(file)
        self._classes = _known()

    def find_class(self, module, name):
        found = self._classes.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of a distributed checkpoint's metadata")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("a .metadata file has no persistent ids")


def read_metadata(path: str):
    """PyTorch's ``Metadata`` object of the checkpoint directory ``path``, unpickled
    without calling anything but the DCP classes (see the module's doc)."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = os.path.join(path, METADATA)
    try:
        with open(file, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except OSError as e:
        raise CheckpointError(f"cannot read {file}: {e.strerror or e}") from None
    except RecursionError:
        raise CheckpointError(f"{file} is not a distributed checkpoint's metadata (nested too deep).") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same
        raise CheckpointError(
            f"{file} is not a readable distributed checkpoint metadata file ({type(e).__name__}: {e})."
        ) from None
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"{file} holds a {type(meta).__name__}, not a distributed checkpoint's Metadata.")
    return meta


class Chunk(NamedTuple):
    """A block of a tensor (``offsets``, ``sizes``) and where it is stored."""

    offsets: tuple
    sizes: tuple
    file: str  # relative to the checkpoint directory
    start: int
    length: int


class TensorInfo(NamedTuple):
    dtype: torch.dtype
    shape: tuple
    chunks: list


def tensors(meta, path: str) -> dict:
    """``key -> TensorInfo`` for every tensor of ``meta`` (the non-tensor values a
    checkpoint may hold are left out), each field checked (see the module's doc)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    where = os.path.join(path, METADATA)
    entries = getattr(meta, "state_dict_metadata", None)
    storage = getattr(meta, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{where} is corrupt: its state_dict_metadata or storage_data is not a dict.")
    out = {}
    files: dict = {}
    for key, item in entries.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{where} is corrupt: a key is {type(key).__name__}, not a str.")
        if isinstance(item, BytesStorageMetadata):
            continue  # a value that is not a tensor (a step count, bytes)
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"{where} is corrupt: {key!r} is described by {type(item).__name__}.")

        def bad(why, key=key):
            return CheckpointError(f"{where} is corrupt: {key!r} {why}.")

        properties = getattr(item, "properties", None)
        dtype = getattr(properties, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            raise bad(f"has dtype {dtype!r}")
        layout = getattr(properties, "layout", torch.strided)
        if layout is not torch.strided:
            raise bad(f"has layout {layout!r}; only dense (strided) tensors are read")
        shape = _shape(getattr(item, "size", None), bad, "size")
        listed = getattr(item, "chunks", None)
        if not isinstance(listed, list):
            raise bad("has no list of chunks")
        chunks = []
        for chunk in listed:
            offsets = _shape(getattr(chunk, "offsets", None), bad, "chunk offset")
            sizes = _shape(getattr(chunk, "sizes", None), bad, "chunk size")
            if len(offsets) != len(shape) or len(sizes) != len(shape):
                raise bad(f"has a chunk at {list(offsets)} of {list(sizes)} for a tensor of {list(shape)}")
            if any(o + n > d for o, n, d in zip(offsets, sizes, shape)):
                raise bad(f"has a chunk at {list(offsets)} of {list(sizes)} outside its size {list(shape)}")
            if not math.prod(sizes):
                continue  # an empty shard: nothing stored, nothing to read
            info = storage.get(MetadataIndex(key, offsets))
            if info is None:
                raise bad(f"has no storage record for its chunk at {list(offsets)}")
            name = _file(info, path, files, bad, key)
            begin, length = getattr(info, "offset", None), getattr(info, "length", None)
            if type(begin) is not int or type(length) is not int or begin < 0 or length < 0:
                raise bad(f"has a chunk stored at offset {begin!r}, length {length!r}")
            if begin + length > files[name]:
                raise bad(f"has a chunk stored at bytes {begin}..{begin + length} of {name}, which has {files[name]}")
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"{key!r} of {path} is stored with transforms {list(info.transform_descriptors)} "
                    "(compression); load_checkpoint reads untransformed chunks only. Load it with "
                    "torch.distributed.checkpoint.load, or save without the extension."
                )
            chunks.append(Chunk(offsets, sizes, name, begin, length))
        _check_cover(chunks, shape, bad)
        out[key] = TensorInfo(dtype, shape, chunks)
    return out


def _shape(x, bad, what) -> tuple:
    if not isinstance(x, (torch.Size, tuple, list)) or any(type(n) is not int or n < 0 for n in x):
        raise bad(f"has {what} {x!r}")
    return tuple(x)


def _file(info, path: str, files: dict, bad, key: str) -> str:
    """The chunk's file, a regular file inside ``path`` (no absolute path, no
    ``..``, no symbolic link leading out); its size is remembered in ``files``."""
    name = getattr(info, "relative_path", None)
    if name in files:
        return name
    if not isinstance(name, str) or not name or os.path.isabs(name) or "\\" in name or "\0" in name:
        raise bad(f"is stored in {name!r}, not a file name inside the checkpoint")
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise bad(f"is stored in {name!r}, not a file name inside the checkpoint")
    full = os.path.join(path, name)
    root = os.path.realpath(path)
    if os.path.commonpath([root, os.path.realpath(full)]) != root:
        raise bad(f"is stored in {name!r}, which leads outside the checkpoint directory")
    try:
        st = os.stat(full)
    except OSError as e:
        message = f"cannot read {full}: {e.strerror or e} ({os.path.join(path, METADATA)} puts {key!r} in {name})."
        if e.errno == errno.ENOENT:
            # Also a FileNotFoundError, as for a file an index names.
            raise CheckpointNotFoundError(message, full) from None
        raise CheckpointError(message) from None
    if not os.path.isfile(full):
        raise bad(f"is stored in {name!r}, which is not a regular file")
    files[name] = st.st_size
    return name


def _check_cover(chunks: list, shape: tuple, bad) -> None:
    """The chunks do not overlap and together hold every element."""
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape):
        raise bad(f"has chunks holding {sum(math.prod(c.sizes) for c in chunks)} elements of {math.prod(shape)}")
    if not shape:
        return
    ordered = sorted(chunks, key=lambda c: c.offsets)
    active: list = []
    for c in ordered:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > c.offsets[0]]
        for a in active:
            if intersect(a.offsets, a.sizes, c.offsets, c.sizes) is not None:
                raise bad(f"has overlapping chunks at {list(a.offsets)} and {list(c.offsets)}")
        active.append(c)
