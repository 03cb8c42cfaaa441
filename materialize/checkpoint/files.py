"""Checkpoint files: safetensors and ``torch.save`` archives, read by position.

Opening a file reads its header only: safetensors' JSON header, or the
pickle of a ``torch.save`` zip archive loaded onto the meta device (which
tells each storage's position in the file).  Tensors are read later, piece
by piece, with ``pread`` at those positions (:mod:`.copying`).  The file's
identity (device, inode, size, modification time) is kept: before a replay
reads it, :meth:`CheckpointFile.check` makes sure it is the same file, or
at least that its header still says the same about every tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zipfile

import torch

from deferinit.errors import CheckpointError, CheckpointReadError

from .copying import copy_strided
from .entries import Entry, contiguous_strides

# safetensors dtype names (https://github.com/huggingface/safetensors, format.md).
SAFETENSORS_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
        "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
        "C64": "complex64",
    }.items()
    if hasattr(torch, attr)
}
# A header larger than this is not a safetensors header (the format's own limit).
_MAX_HEADER = 100_000_000


def _identity(st) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class CheckpointFile:
    """A checkpoint file: its path, identity, and the layout of each tensor in it.

    Open one with :meth:`open`, which returns its :class:`Entry` objects; the
    file keeps only their layouts (entries point to their file, never the
    reverse: the record that holds entries frees them by reference counting).
    """

    kind = "checkpoint"

    def __init__(self, path: str):
        self.path = os.path.abspath(os.fspath(path))
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise CheckpointError(f"cannot open the checkpoint {self.path}: {e.strerror or e}") from None
        self.identity = _identity(st)
        self.layouts: dict = {}

    @classmethod
    def open(cls, path: str) -> dict:
        """``key -> Entry`` of the file at ``path`` (its header read and checked)."""
        file = cls(path)
        entries = file.parse(CheckpointError)
        file.layouts = {key: _layout(e) for key, e in entries.items()}
        return entries

    def parse(self, error) -> dict:
        raise NotImplementedError

    def describe(self) -> str:
        return self.path

    # -- reading ------------------------------------------------------------

    def copy(self, entry, offset, sizes, strides, dst, via=None) -> int:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointReadError(
                f"cannot read {entry.describe()}: {e.strerror or e}. Nothing was changed; the tensors stay deferred."
            ) from None
        if hasattr(os, "posix_fadvise"):
            # Exactly the bytes asked for: no readahead into a shard another rank reads.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        try:
            def read(position: int, buffer: memoryview) -> None:
                done = 0
                while done < len(buffer):
                    n = os.preadv(fd, [buffer[done : done + (1 << 30)]], position + done)
                    if n <= 0:
                        raise CheckpointReadError(
                            f"{entry.describe()} ends at byte {position + done} of {len(buffer)} expected "
                            "(the file is truncated). Nothing was changed; the tensors stay deferred."
                        )
                    done += n

            return copy_strided(read, entry.base, entry.dtype, offset, sizes, strides, dst, via)
        finally:
            os.close(fd)

    def check(self, entry=None) -> None:
        """The file is still the one opened, or says the same about every tensor."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            what = entry.describe() if entry is not None else self.path
            raise CheckpointReadError(
                f"cannot read {what}: {e.strerror or e} (it was there when load_checkpoint read its "
                "header). Nothing was changed; the tensors stay deferred."
            ) from None
        if _identity(st) == self.identity:
            return
        try:
            entries = self.parse(CheckpointReadError)
        except CheckpointReadError as e:
            raise CheckpointReadError(
                f"{e} It changed since load_checkpoint read it. Nothing was changed; the tensors stay deferred."
            ) from None
        for key, old in self.layouts.items():
            new = entries.get(key)
            if new is None or _layout(new) != old:
                now = "no such tensor" if new is None else f"{list(new.shape)} {new.dtype}"
                raise CheckpointReadError(
                    f"{self.path} changed since load_checkpoint read it: {key!r} was "
                    f"{list(old[1])} {old[0]}, now {now} (or at another position). "
                    "Call load_checkpoint again. Nothing was changed; the tensors stay deferred."
                )
        self.identity = _identity(st)

    def _check_extent(self, entry, size: int, error) -> None:
        if not entry.shape or math.prod(entry.shape):
            last = entry.offset + sum((n - 1) * s for n, s in zip(entry.shape, entry.strides))
            end = entry.base + (last + 1) * entry.dtype.itemsize
            if end > size:
                raise error(
                    f"{self.path} is truncated: {entry.key!r} ends at byte {end}, the file has {size}."
                )


def _layout(e: Entry) -> tuple:
    return (e.dtype, e.shape, e.base, e.offset, e.strides)


class SafetensorsFile(CheckpointFile):
    """A ``.safetensors`` file."""

    kind = "safetensors"

    def parse(self, error) -> dict:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                raw = f.read(8)
                if len(raw) < 8:
                    raise error(f"{self.path} is not a safetensors file: {size} bytes, no header.")
                (n,) = struct.unpack("<Q", raw)
                if n > min(_MAX_HEADER, size - 8):
                    raise error(f"{self.path} is not a safetensors file (or is truncated): its header would be {n} bytes.")
                header = json.loads(f.read(n))
        except OSError as e:
            raise error(f"cannot read {self.path}: {e.strerror or e}") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise error(f"{self.path} has a corrupt safetensors header: {e}") from None
        if not isinstance(header, dict):
            raise error(f"{self.path} has a corrupt safetensors header (not a JSON object).")
        start = 8 + n
        entries = {}
        for key, info in header.items():
            if key == "__metadata__":
                continue
            try:
                name, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise error(f"{self.path} has a corrupt safetensors header entry for {key!r}: {info!r}") from None
            dtype = SAFETENSORS_DTYPES.get(name)
            if dtype is None:
                raise error(f"{key!r} of {self.path} has dtype {name}, which this PyTorch cannot hold.")
            entry = Entry(self, key, dtype, shape, start + begin, 0, contiguous_strides(shape))
            if end - begin != entry.nbytes:
                raise error(f"{self.path} has a corrupt safetensors header: {key!r} spans {end - begin} bytes for {list(shape)} {name}.")
            self._check_extent(entry, size, error)
            entries[key] = entry
        return entries


class TorchFile(CheckpointFile):
    """A ``torch.save`` zip archive (the default format since PyTorch 1.6).

    Loaded onto the meta device with ``weights_only=True``: PyTorch then
    tells where each storage's bytes are in the file.  Nested dicts are
    flattened with dots (``{"model": {"w": ...}}`` gives ``"model.w"``).
    """

    kind = "torch"

    def parse(self, error) -> dict:
        try:
            obj = torch.load(self.path, map_location="meta", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure means the same
            raise error(f"cannot read {self.path} with torch.load(weights_only=True): {type(e).__name__}: {e}") from None
        size = os.stat(self.path).st_size
        entries = {}
        for key, t in flatten_tensors(obj):
            base = getattr(t.untyped_storage(), "_checkpoint_offset", None)
            if base is None:
                raise error(f"{self.path}: PyTorch did not report where {key!r} is stored in the file.")
            entry = Entry(self, key, t.dtype, t.shape, base, t.storage_offset(), t.stride())
            self._check_extent(entry, size, error)
            entries[key] = entry
        return entries


def flatten_tensors(obj, prefix: str = ""):
    """``(dotted key, tensor)`` for every tensor in nested dicts (other values skipped)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten_tensors(v, f"{prefix}.{k}" if prefix else str(k))


def is_torch_zip(path: str) -> bool:
    return zipfile.is_zipfile(path)
