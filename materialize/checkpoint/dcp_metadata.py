"""The ``.metadata`` file of a distributed checkpoint, read without running it.

``FileSystemReader.read_metadata`` unpickles ``.metadata`` with
``pickle.load``, which calls whatever the file names.  Here the file must
be a regular file inside the checkpoint directory (a symbolic link leading
out is refused, as for every file the checkpoint names), passes the guard
every checkpoint pickle passes (:mod:`.pickle_scan`: bounded tuples, the
one set of globals: PyTorch's ``Metadata``, ``TensorStorageMetadata``,
``ChunkStorageMetadata``, ``MetadataIndex``, ``_StorageInfo``...), and is
unpickled by an unpickler that finds nothing else; a custom planner's own
classes in ``planner_data`` are refused too (``dcp.load`` would import and
call them).  :func:`tensors` then checks every field a load reads, as
untrusted input, each refusal naming the field: types, shapes, chunks
inside their tensor, not overlapping and covering it, a storage record for
each chunk, its file a plain name of a regular file inside the directory.
Everything is linear in the number of tensors and chunks.

Example::

    >>> meta = read_metadata("/ckpt/step-100")        # PyTorch's Metadata object
    >>> tensors(meta, "/ckpt/step-100")["layers.0.w"].chunks[0].offsets
    (0, 0)
"""

from __future__ import annotations

import errno
import io
import math
import os
from typing import NamedTuple

import torch

from .errors import CheckpointError, CheckpointNotFoundError
from .files import open_regular
from .index import inside
from .pickle_scan import MAX_PICKLE, RestrictedUnpickler, ScanError, allowed, guard, short

METADATA = ".metadata"  # torch.distributed.checkpoint.filesystem._metadata_fn


def read_metadata(path: str):
    """PyTorch's ``Metadata`` object of the checkpoint directory ``path``, unpickled
    without calling anything but the DCP classes (see the module's doc)."""
    from torch.distributed.checkpoint.metadata import Metadata

    file = inside(path, METADATA, f"the distributed checkpoint {path}")
    with open_regular(file) as f:
        data = f.read(MAX_PICKLE + 1)
    names = allowed()
    try:
        guard(data, names)
        meta = RestrictedUnpickler(io.BytesIO(data), names).load()
    except (ScanError, MemoryError, RecursionError) as e:
        raise CheckpointError(f"{file} is not a distributed checkpoint's metadata: {e}.") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same
        raise CheckpointError(
            f"{file} is not a readable distributed checkpoint metadata file ({type(e).__name__}: {short(str(e))})."
        ) from None
    if type(meta) is not Metadata:
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
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    where = os.path.join(path, METADATA)

    def bad(field, why):
        return CheckpointError(f"{where} is corrupt: its {field} {why}.")

    entries = vars(meta).get("state_dict_metadata")
    storage = vars(meta).get("storage_data")
    for field, value in (("state_dict_metadata", entries), ("storage_data", storage)):
        if type(value) is not dict:
            raise bad(field, f"is {short(value)}, not a dict")
    stored = {}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            raise bad("storage_data", f"maps {short(index)} to {short(info)}, not a MetadataIndex to a _StorageInfo")
        fqn, offset = vars(index).get("fqn"), vars(index).get("offset")
        if type(fqn) is not str or type(offset) not in (torch.Size, type(None)):
            raise bad("storage_data", f"has a key for {short(fqn)} at {short(offset)}")
        if offset is not None:  # None: a value that is not a tensor
            stored[(fqn, tuple(offset))] = info
    out, sizes = {}, {}
    for key, item in entries.items():
        field = f"state_dict_metadata[{short(key)}]"
        if type(key) is not str:
            raise bad("state_dict_metadata", f"has a key {short(key)}, not a str")
        if type(item) is BytesStorageMetadata:
            continue  # a value that is not a tensor (a step count, bytes)
        if type(item) is not TensorStorageMetadata:
            raise bad(field, f"is {type(item).__name__}, not a TensorStorageMetadata")
        properties = vars(item).get("properties")
        dtype, layout = getattr(properties, "dtype", None), getattr(properties, "layout", torch.strided)
        if not isinstance(dtype, torch.dtype):
            raise bad(f"{field}.properties.dtype", f"is {short(dtype)}")
        if layout is not torch.strided:
            raise bad(f"{field}.properties.layout", f"is {short(layout)}; only dense (strided) tensors are read")
        shape = vars(item).get("size")
        if type(shape) is list:
            # dcp.load compares it with the tensor's torch.Size: a list never equals one.
            raise bad(f"{field}.size", f"is the list {short(shape)}, not a torch.Size (dcp.load refuses it)")
        shape = _ints(shape, bad, f"{field}.size")
        listed = vars(item).get("chunks")
        if type(listed) is not list:
            raise bad(f"{field}.chunks", f"is {short(listed)}, not a list")
        chunks = []
        for i, chunk in enumerate(listed):
            at = f"{field}.chunks[{i}]"
            offsets = _ints(getattr(chunk, "offsets", None), bad, f"{at}.offsets")
            extent = _ints(getattr(chunk, "sizes", None), bad, f"{at}.sizes")
            if len(offsets) != len(shape) or len(extent) != len(shape):
                raise bad(at, f"is at {list(offsets)} of {list(extent)}, for a tensor of {list(shape)}")
            if any(o + n > d for o, n, d in zip(offsets, extent, shape)):
                raise bad(at, f"is at {list(offsets)} of {list(extent)}, outside the tensor's {list(shape)}")
            if not math.prod(extent):
                continue  # an empty shard: nothing stored, nothing to read
            info = stored.get((key, offsets))
            if info is None:
                raise bad("storage_data", f"has no record for {at}, at {list(offsets)}")
            record = f"storage_data[{key!r} at {list(offsets)}]"
            name = _file(vars(info).get("relative_path"), path, sizes, bad, f"{record}.relative_path", key)
            begin, length = vars(info).get("offset"), vars(info).get("length")
            if type(begin) is not int or type(length) is not int or begin < 0 or length < 0:
                raise bad(record, f"puts it at offset {short(begin)}, length {short(length)}")
            if begin + length > sizes[name]:
                raise bad(record, f"puts it at bytes {begin}..{begin + length} of {name}, which has {sizes[name]}")
            transforms = vars(info).get("transform_descriptors")
            if transforms:
                raise CheckpointError(
                    f"{key!r} of {path} is stored with transforms {short(transforms)} (compression); "
                    "load_checkpoint reads untransformed chunks only. Load it with "
                    "torch.distributed.checkpoint.load, or save without the extension."
                )
            chunks.append(Chunk(offsets, extent, name, begin, length))
        _check_cover(chunks, shape, lambda why, f=field: bad(f"{f}.chunks", why))
        out[key] = TensorInfo(dtype, shape, chunks)
    return out


def _ints(x, bad, field) -> tuple:
    if type(x) not in (torch.Size, tuple, list) or any(type(n) is not int or n < 0 for n in x):
        raise bad(field, f"is {short(x)}, not a list of non-negative integers")
    return tuple(x)


def _file(name, path: str, sizes: dict, bad, field: str, key: str) -> str:
    """The chunk's file, a regular file inside ``path`` (no absolute path, no
    ``..``, no symbolic link leading out); its size is remembered in ``sizes``."""
    if type(name) is str and name in sizes:
        return name
    if type(name) is not str or not name or any(p in ("", ".", "..") for p in name.split("/")) or "\\" in name:
        raise bad(field, f"is {short(name)}, not a file name inside the checkpoint")
    full = inside(path, name, f"{os.path.join(path, METADATA)}, in its {field},")
    try:
        with open_regular(full) as f:
            sizes[name] = os.fstat(f.fileno()).st_size
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(
            f"cannot read {full}: {os.strerror(errno.ENOENT)} ({os.path.join(path, METADATA)} puts {key!r} in {name}).",
            full,
        ) from None
    return name


def _check_cover(chunks: list, shape: tuple, bad) -> None:
    """The chunks tile the tensor: no overlap, no element left out.  A box's
    indicator is the signed sum of unit steps at its corners, and these are
    independent: the chunks' indicators add up to the tensor's exactly when
    their corners' signs add up to its own (work linear in the chunks, times
    two to the number of dimensions the chunks split)."""
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(shape):
        raise bad(f"hold {sum(math.prod(c.sizes) for c in chunks)} elements of {math.prod(shape)}")
    split = [d for d in range(len(shape)) if any(c.offsets[d] or c.sizes[d] != shape[d] for c in chunks)]
    if len(split) > 16:
        raise bad(f"split the tensor along {len(split)} dimensions (load_checkpoint reads at most 16)")
    signs: dict = {}
    boxes = [(c.offsets, c.sizes, 1) for c in chunks] + [((0,) * len(shape), shape, -1)]
    for offsets, sizes, weight in boxes:
        lo = [offsets[d] for d in split]
        hi = [offsets[d] + sizes[d] for d in split]
        for mask in range(1 << len(split)):
            corner = tuple(hi[k] if mask >> k & 1 else lo[k] for k in range(len(split)))
            sign = -weight if bin(mask).count("1") % 2 else weight
            signs[corner] = signs.get(corner, 0) + sign
    if any(signs.values()):
        raise bad("overlap, or leave elements of the tensor out")
