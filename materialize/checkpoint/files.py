"""Checkpoint files: safetensors and ``torch.save`` archives, read by position.

Opening a file reads its header only, and checks it as untrusted input:
safetensors' JSON header by every rule of the format
(:mod:`.safetensors_header`), a ``torch.save`` zip archive through its
central directory and local headers (:mod:`.torch_zip`) and its pickle by
PyTorch's weights-only unpickler onto meta storages (:mod:`.torch_pickle`).
Every tensor is then known to lie inside the file.  Tensors are read later,
piece by piece, with ``pread`` at those positions (:mod:`.copying`); a
record a zip tool deflated is decompressed whole when read, and the
elements of a big-endian archive are byte-swapped as ``torch.load`` swaps
them.  The file's identity (device, inode, size, modification time) is kept: before a replay
reads it, :meth:`CheckpointFile.check` makes sure it is the same file, or
at least that its header still says the same about every tensor.
"""

from __future__ import annotations

import os
import stat
import sys

import numpy
import torch

from deferinit.errors import CheckpointError, CheckpointNotFoundError, CheckpointReadError

from .copying import copy_strided
from .entries import Entry, contiguous_strides
from .safetensors_header import HeaderError, read_header
from .nested import flatten_tensors
from .torch_legacy import parse_legacy
from .torch_pickle import PickleError, check_geometry, unpickle
from .torch_zip import Archive, ArchiveError


def _identity(st) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class CheckpointFile:
    """A checkpoint file: its path, identity, and the layout of each tensor in it.

    Open one with :meth:`open`, which returns its :class:`Entry` objects; the
    file keeps only their layouts (entries point to their file, never the
    reverse: the record that holds entries frees them by reference counting).
    """

    kind = "checkpoint"
    # What a file of this kind is not when it is refused, for error messages.
    what = "not a checkpoint file"

    def __init__(self, path: str):
        self.path = os.path.abspath(os.fspath(path))
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no checkpoint at {self.path}: no such file or directory.", self.path) from None
        except OSError as e:
            raise CheckpointError(f"cannot open the checkpoint {self.path}: {e.strerror or e}") from None
        self.identity = _identity(st)
        self.layouts: dict = {}

    @classmethod
    def open(cls, path: str) -> dict:
        """``key -> Entry`` of the file at ``path`` (its header read and checked)."""
        file = cls(path)
        entries = file.parse(CheckpointError)
        file.layouts = {key: file.layout(e) for key, e in entries.items()}
        return entries

    def parse(self, error) -> dict:
        """Read and check the header; ``error``: the class to raise."""
        try:
            with open_regular(self.path, error) as f:
                st = os.fstat(f.fileno())
                entries = self._parse(f, st.st_size)
        except (HeaderError, ArchiveError, PickleError) as e:
            raise error(f"{self.path} is {self.what}: {e}.") from None
        except OSError as e:
            raise error(f"cannot read {self.path}: {e.strerror or e}") from None
        self.identity = _identity(st)
        return entries

    def _parse(self, f, size: int) -> dict:
        raise NotImplementedError

    def layout(self, e: Entry) -> tuple:
        return (e.dtype, e.shape, e.base, e.offset, e.strides)

    def describe(self) -> str:
        return self.path

    # -- reading ------------------------------------------------------------

    def reader(self, entry, fd: int):
        """``read(position, buffer)``: the file's bytes at ``position``."""

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

        return read

    def copy(self, entry, offset, sizes, strides, dst, via=None) -> int:
        fd = open_to_read(self.path, entry)
        try:
            return copy_strided(self.reader(entry, fd), entry.base, entry.dtype, offset, sizes, strides, dst, via)
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
        identity = self.identity
        try:
            entries = self.parse(CheckpointReadError)
        except CheckpointReadError as e:
            raise CheckpointReadError(
                f"{e} It changed since load_checkpoint read it. Nothing was changed; the tensors stay deferred."
            ) from None
        for key, old in self.layouts.items():
            new = entries.get(key)
            if new is None or self.layout(new) != old:
                self.identity = identity
                now = "no such tensor" if new is None else f"{list(new.shape)} {new.dtype}"
                raise CheckpointReadError(
                    f"{self.path} changed since load_checkpoint read it: {key!r} was "
                    f"{list(old[1])} {old[0]}, now {now} (or at another position). "
                    "Call load_checkpoint again. Nothing was changed; the tensors stay deferred."
                )


class SafetensorsFile(CheckpointFile):
    """A ``.safetensors`` file, its header checked as the safetensors library checks it."""

    kind = "safetensors"
    what = "not a valid safetensors file"

    def _parse(self, f, size: int) -> dict:
        _, tensors = read_header(f, size)
        return {
            key: Entry(self, key, dtype, shape, position, 0, contiguous_strides(shape))
            for key, dtype, shape, position in tensors
        }


class TorchFile(CheckpointFile):
    """A ``torch.save`` zip archive (the default format since PyTorch 1.6).

    Its tensors are what ``torch.load(path, map_location="cpu",
    weights_only=True)`` gives; nested dicts are flattened with dots
    (``{"model": {"w": ...}}`` gives ``"model.w"``).
    """

    kind = "torch"
    what = "not a torch.save archive that torch.load(weights_only=True) reads"

    def __init__(self, path: str):
        super().__init__(path)
        # key -> (the record's name when it is deflated, else None; bytes swapped together)
        self.records: dict = {}

    def _parse(self, f, size: int) -> dict:
        archive = Archive(f, size)
        swap = archive.check() != sys.byteorder.encode()

        def lookup(name: str, nbytes: int):
            info = archive.get(name)
            if info is None:
                raise ArchiveError(f"its pickle names a storage {name!r} that has no record")
            if info.file_size != nbytes:
                raise ArchiveError(
                    f"record {info.orig_filename!r} has {info.file_size} bytes, its pickle says {nbytes}"
                )
            return info, archive.position(info)

        return self._entries(*unpickle(archive.pickle(), lookup), swap)

    def _entries(self, obj, storages: dict, swap: bool) -> dict:
        """The entries of the tensors in ``obj``, unpickled onto the meta storages
        ``storages``; ``swap``: the archive is big-endian."""
        entries, records = {}, {}
        # Through the class: a pickle can set attributes that shadow a tensor's methods.
        T = torch.Tensor
        for key, t in flatten_tensors(obj, PickleError, "its pickle"):
            dense = type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and t.is_meta
            storage = storages.get(T.untyped_storage(t)._cdata) if dense else None
            if storage is None:
                raise PickleError(f"{key!r} is not a dense tensor stored in the archive")
            if T.is_conj(t) or T.is_neg(t):
                raise PickleError(f"{key!r} is saved as a conjugate or negative view, which load_checkpoint does not read")
            offset, strides, itemsize = T.storage_offset(t), T.stride(t), t.dtype.itemsize
            check_geometry(offset, t.shape, strides, itemsize, storage.nbytes, repr(key))
            unit = storage.swap_unit() if swap else 1
            if unit > 1 and unit != itemsize and not (t.dtype.is_complex and 2 * unit == itemsize):
                raise PickleError(f"{key!r} is {t.dtype} over a big-endian {storage.dtype} storage")
            info, position = storage.info or (None, 0)
            deflated = None if info is None or info.compress_type == 0 else info.orig_filename
            entries[key] = Entry(self, key, t.dtype, tuple(t.shape), position, offset, strides)
            records[key] = (deflated, unit)
        self.records = records
        return entries

    def layout(self, e: Entry) -> tuple:
        return (*super().layout(e), self.records.get(e.key))

    def reader(self, entry, fd: int):
        deflated, unit = self.records[entry.key]
        read = super().reader(entry, fd)
        if deflated is not None:
            read = self._inflated(entry, deflated)
        if unit == 1:
            return read

        def swapped(position: int, buffer: memoryview) -> None:
            read(position, buffer)
            # Reads are of whole elements: reverse each unit's bytes in place.
            units = numpy.frombuffer(buffer, dtype=numpy.uint8).reshape(-1, unit)
            units[:] = units[:, ::-1].copy()

        return swapped

    def _inflated(self, entry, name: str):
        import zipfile

        try:
            with zipfile.ZipFile(self.path) as archive, archive.open(name) as member:
                data = member.read()
        except Exception as e:  # noqa: BLE001 - a damaged archive, whatever the exception
            raise CheckpointReadError(
                f"cannot read {entry.describe()}: {type(e).__name__}: {e}. Nothing was changed; the tensors stay deferred."
            ) from None

        def read(position: int, buffer: memoryview) -> None:
            if position + len(buffer) > len(data):
                raise CheckpointReadError(
                    f"{entry.describe()}: its record has {len(data)} bytes, {position + len(buffer)} are needed. "
                    "Nothing was changed; the tensors stay deferred."
                )
            buffer[:] = data[position : position + len(buffer)]

        return read


class LegacyTorchFile(TorchFile):
    """A legacy ``torch.save`` file (``_use_new_zipfile_serialization=False``),
    read by position like an archive (:mod:`.torch_legacy`), never by ``torch.load``."""

    # Tried last, when the file is neither a zip archive nor a safetensors file.
    what = "neither a safetensors file nor a torch.save file that torch.load(weights_only=True) reads"

    def _parse(self, f, size: int) -> dict:
        return self._entries(*parse_legacy(f, size), False)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_to_read(path: str, entry) -> int:
    """A descriptor of ``path`` (still a regular file) for reading ``entry``'s bytes
    by position; :class:`CheckpointReadError` if it cannot be read now."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(0, "it is no longer a regular file")
    except OSError as e:
        raise CheckpointReadError(
            f"cannot read {entry.describe()}: {e.strerror or e}. Nothing was changed; the tensors stay deferred."
        ) from None
    if hasattr(os, "posix_fadvise"):
        # Exactly the bytes asked for: no readahead into a shard another rank reads.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def open_regular(path: str, error=CheckpointError):
    """``path`` open for reading in binary, refused (``error``) unless it is a
    regular file: a FIFO would block forever, a device never ends.

    Example::

        >>> open_regular("/dev/zero")
        Traceback (most recent call last):
        ...
        deferinit.errors.CheckpointError: /dev/zero is a character device, not a regular file: ...
    """
    try:
        # Non-blocking: opening a FIFO would wait for a writer.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint at {os.path.abspath(path)}: no such file or directory.", os.path.abspath(path)) from None
    except OSError as e:
        raise error(f"cannot open {os.path.abspath(path)}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "not a file")
        raise error(f"{os.path.abspath(path)} is {kind}, not a regular file: load_checkpoint reads checkpoint files only.")
    return os.fdopen(fd, "rb")


def is_torch_zip(path: str) -> bool:
    """Whether ``torch.load`` reads ``path`` as a zip archive: it begins with a
    zip local header (``torch.serialization._is_zipfile``)."""
    with open_regular(path) as f:
        return f.read(4) == b"PK\x03\x04"
