"""Checkpoints read by position: the source of file tensors, and its safetensors and ``torch.save`` files.

A :class:`Source` is a checkpoint whose tensors lie at known positions in
files whose identity (device, inode, size, modification time) it keeps.
Opening one reads and checks its headers only, as untrusted input; its
tensors are read later, piece by piece, with ``pread`` straight into their
final memory (:mod:`.copying`), every byte asked for (a file cut short
since is an error, never a SIGBUS); and before a replay reads it,
:meth:`Source.check` makes sure its files are those opened, or at least
that their headers still say the same about the tensor (check, then
re-parse).  Sources: :class:`SafetensorsFile` (its header read and checked
by the safetensors library), :class:`TorchFile` (a ``torch.save`` archive,
read by torch's own loader: :mod:`.archive`), and a distributed
checkpoint's directory (:class:`.dcp.DcpCheckpoint`).
"""

from __future__ import annotations

import io
import math
import os
import stat
import struct

import numpy
import torch

from .errors import CheckpointError, CheckpointNotFoundError, CheckpointReadError
from .archive import ArchiveError, inflate, layout, read_archive
from .copying import copy_strided
from .entries import Entry, contiguous_strides
from .nested import flatten_tensors
from .parallel import in_pieces

_I64 = 2**63 - 1
_NOTHING_CHANGED = " Nothing was changed; the tensors stay deferred."


def identity(path) -> tuple:
    """What tells a file apart from another, or from itself rewritten (``path``: a path, an open file or a descriptor)."""
    if isinstance(path, int):
        st = os.fstat(path)
    else:
        st = os.fstat(path.fileno()) if hasattr(path, "fileno") else os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class Source:
    """A checkpoint read by position: its files' identities and the layout of each
    tensor (what a re-parse must find again).  Subclasses parse (:meth:`_parse`:
    ``key -> (Entry, layout)``, the files read noted in ``identities``) and copy."""

    # What a file of this kind is not when it is refused, for error messages.
    what = "not a checkpoint file"

    def __init__(self, path: str):
        self.path = os.path.abspath(os.fspath(path))
        self.identities: dict = {}
        self.layouts: dict = {}

    def open(self) -> dict:
        """``key -> Entry`` (the headers read and checked)."""
        found, self.identities = self.parse(CheckpointError)
        self.layouts = {key: lay for key, (_, lay) in found.items()}
        return {key: entry for key, (entry, _) in found.items()}

    def parse(self, error) -> tuple[dict, dict]:
        """``(key -> (Entry, layout), identities)``; ``error``: the class raised."""
        identities: dict = {}
        return self.reading(error, self._parse, identities), identities

    def reading(self, error, read, *args):
        """``read(*args)``, what it finds wrong raised as ``error``."""
        try:
            return read(*args)
        except ArchiveError as e:
            raise error(f"{self.path} is {self.what}: {e}.") from None
        except CheckpointError as e:
            if isinstance(e, CheckpointNotFoundError) and error is CheckpointError:
                raise
            raise error(str(e)) from None
        except OSError as e:
            raise error(f"cannot read {self.path}: {e.strerror or e}") from None

    def _parse(self, identities: dict) -> dict:
        raise NotImplementedError

    def files(self, key: str) -> list:
        """The files ``key``'s tensor is read from (and whose header says where)."""
        return [self.path]

    def describe(self) -> str:
        return self.path

    def need(self, entries) -> None:
        """Read now what reading ``entries`` (whole tensors or blocks of them) will
        need, so that ``load_checkpoint`` refuses it; a file's header is read at once."""

    def check(self, entry) -> None:
        """The files ``entry`` is read from are still those opened, or say the same about it."""
        try:
            same = all(identity(p) == self.identities.get(p) for p in self.files(entry.key))
        except OSError as e:
            raise CheckpointReadError(
                f"cannot read {entry.describe()}: {e.strerror or e} (it was there when load_checkpoint read its "
                f"header).{_NOTHING_CHANGED}"
            ) from None
        if same:
            return
        try:
            now, identities = self._reparse(entry.key)
        except CheckpointReadError as e:
            raise CheckpointReadError(f"{e} It changed since load_checkpoint read it.{_NOTHING_CHANGED}") from None
        if now is None or now != self._layout(entry.key):
            raise CheckpointReadError(
                f"{self.describe()} changed since load_checkpoint read it: {entry.key!r} is no longer stored as it "
                f"was (or another save replaced it). Call load_checkpoint again.{_NOTHING_CHANGED}"
            )
        self.identities.update(identities)

    def _reparse(self, key: str) -> tuple:
        """``(layout of key or None, identities)`` as the files say now."""
        found, identities = self.parse(CheckpointReadError)
        now = found.get(key)
        return (None if now is None else now[1]), identities

    def _layout(self, key: str):
        """What a re-parse must find again for ``key``."""
        return self.layouts[key]

    @staticmethod
    def reader(entry, fd: int):
        """``read(position, buffer)``: exactly ``len(buffer)`` bytes of the file ``fd``
        from ``position``, straight into ``buffer``; a large buffer is read in
        pieces by as many threads as torch's intra-op setting allows
        (:func:`.parallel.in_pieces`)."""

        def read_piece(position: int, buffer: memoryview) -> None:
            done = 0
            while done < len(buffer):
                try:
                    n = os.preadv(fd, [buffer[done : done + (1 << 30)]], position + done)
                except OSError as e:  # an I/O error of the disk, a file system gone
                    raise CheckpointReadError(
                        f"cannot read {entry.describe()}: {e.strerror or e} (at byte {position + done})."
                        f"{_NOTHING_CHANGED}"
                    ) from None
                if n <= 0:
                    raise CheckpointReadError(
                        f"{entry.describe()} ends at byte {position + done} of {position + len(buffer)} expected "
                        f"(the file is truncated).{_NOTHING_CHANGED}"
                    )
                done += n

        def read(position: int, buffer: memoryview) -> None:
            in_pieces(read_piece, position, buffer)

        return read

    def copy(self, entry, offset, sizes, strides, dst, via=None) -> int:
        """Read the elements ``offset + i . strides`` of ``entry`` into ``dst``; returns the bytes read."""
        with self.open_checked(self.path, entry) as f:
            fd = f.fileno()
            done = copy_strided(self.reader(entry, fd), entry.base, entry.dtype, offset, sizes, strides, dst, via)
            self.still(self.path, fd, entry)
            return done

    def open_checked(self, path: str, entry) -> io.FileIO:
        """``path`` open to read ``entry``, refused unless it is the file checked
        (:meth:`check`): another file may have been put at the path since (an
        ``os.replace`` of a newer save), whose bytes lie elsewhere."""
        f = open_to_read(path, entry)
        try:
            self.still(path, f.fileno(), entry)
        except CheckpointReadError:
            f.close()
            raise
        return f

    def still(self, path: str, fd: int, entry) -> None:
        """The open file ``fd`` is still the one checked: not replaced, nor rewritten
        while it was read (its size or modification time changed)."""
        expected = self.identities.get(path)
        if expected is not None and identity(fd) != expected:
            raise CheckpointReadError(
                f"{path} changed while {entry.describe()} was materialized (replaced by another file or "
                f"rewritten since load_checkpoint read it, or while it was read). Call load_checkpoint again "
                f"with the file as it is now.{_NOTHING_CHANGED}"
            )


# -- safetensors --------------------------------------------------------------------

# The torch dtype safetensors.torch gives for each dtype of the format.
_DTYPES = {name: getattr(torch, attr) for name, attr in {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "C64": "complex64",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F4": "float4_e2m1fn_x2",  # two elements a byte: the last dimension halves
}.items() if hasattr(torch, attr)}


class SafetensorsFile(Source):
    """A ``.safetensors`` file: its header read and checked by the safetensors library
    (``safe_open``), which also checks that the tensors tile the data section in
    the order of their offsets, so that each one's position follows from the
    sizes of those before it."""

    what = "not a valid safetensors file"

    def _parse(self, identities: dict) -> dict:
        from safetensors import SafetensorError, safe_open

        with open_regular(self.path) as f:
            before = identity(f)
            head = f.read(8)
            try:
                with safe_open(self.path, framework="pt") as st:
                    tensors = [(k, st.get_slice(k)) for k in st.offset_keys()]
                    tensors = [(k, s.get_dtype(), tuple(s.get_shape())) for k, s in tensors]
            except (SafetensorError, OSError, ValueError) as e:
                raise ArchiveError(str(e).strip()) from None
            if identity(self.path) != before:
                raise ArchiveError("it changed while its header was read")
        identities[self.path] = before
        position = 8 + struct.unpack("<Q", head)[0]
        found = {}
        for key, name, shape in tensors:
            if name not in _DTYPES:
                raise ArchiveError(f"{key!r} has dtype {name}, which PyTorch cannot hold")
            if any(d > _I64 for d in shape):
                raise ArchiveError(f"{key!r} has shape {list(shape)}, too large for PyTorch")
            if name == "F4":
                if not shape or shape[-1] % 2:
                    raise ArchiveError(f"{key!r} is {list(shape)} F4: PyTorch packs F4 in pairs along an even last dimension")
                shape = (*shape[:-1], shape[-1] // 2)
            lay = (_DTYPES[name], shape, position, 0, contiguous_strides(shape))
            found[key] = (Entry(self, key, *lay), lay)
            position += _DTYPES[name].itemsize * math.prod(shape)
        return found


# -- torch.save archives ----------------------------------------------------------------


class TorchFile(Source):
    """A ``torch.save`` zip archive: its tensors are what ``torch.load(path,
    weights_only=True)`` gives (:mod:`.archive`); nested dicts are flattened with
    dots (``{"model": {"w": ...}}`` gives ``"model.w"``)."""

    what = "not a torch.save archive that torch.load(weights_only=True) reads"

    def _parse(self, identities: dict) -> dict:
        with open_regular(self.path) as f:
            identities[self.path] = identity(f)
            obj, records = read_archive(f)
        if not isinstance(obj, dict):
            raise ArchiveError(f"it holds a {type(obj).__name__}, not a dict of tensors (load_state_dict refuses it)")
        found = {}
        for key, t in flatten_tensors(obj, ArchiveError, "its pickle"):
            record, offset, strides = layout(t, records, repr(key))
            lay = (t.dtype, tuple(t.shape), record.position or 0, offset, strides, record)
            found[key] = (Entry(self, key, *lay[:5]), lay)
        return found

    def reader(self, entry, fd: int):
        return record_reader(self.layouts[entry.key][5], entry, fd, 0, os.fstat(fd).st_size)


def record_reader(record, entry, fd: int, start: int, length: int):
    """``read(position, buffer)`` of a record of the archive at ``[start, start +
    length)`` of the file ``fd``: by position, or inflated whole; big-endian
    elements swapped."""
    read = Source.reader(entry, fd)
    if record.deflated is not None:
        try:
            data = inflate(Window(fd, start, length), *record.deflated, record.nbytes, record.name)
        except (ArchiveError, OSError) as e:
            raise CheckpointReadError(f"cannot read {entry.describe()}: {e}.{_NOTHING_CHANGED}") from None

        def read(position: int, buffer: memoryview) -> None:
            buffer[:] = data[position : position + len(buffer)]

    if record.unit == 1:
        return read

    def swapped(position: int, buffer: memoryview) -> None:
        read(position, buffer)
        # Reads are of whole elements: reverse each unit's bytes in place.
        units = numpy.frombuffer(buffer, dtype=numpy.uint8).reshape(-1, record.unit)
        units[:] = units[:, ::-1].copy()

    return swapped


class Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a read-only, seekable file.

    The last small read is kept: PyTorch's reader reads an archive's last 4 KiB
    to find its end record, then that record and the zip directory again, and
    :mod:`zipfile` reads them once more.
    """

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self._fd, self._start, self._length, self._pos = fd, start, length, 0
        self._kept = (0, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        if base + pos < 0:
            raise OSError("seek before the start of the window")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        if n == 0:
            return 0
        at, kept = self._kept
        if at <= self._pos and self._pos + n <= at + len(kept):
            memoryview(buffer)[:n] = kept[self._pos - at : self._pos - at + n]
            got = n
        else:
            got = os.preadv(self._fd, [memoryview(buffer)[:n]], self._start + self._pos)
            if 1024 <= got <= 1 << 16:
                self._kept = (self._pos, bytes(memoryview(buffer)[:got]))
        self._pos += got
        return got


# -- opening files ---------------------------------------------------------------------

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def open_to_read(path: str, entry) -> io.FileIO:
    """``path`` (still a regular file) open for reading ``entry``'s bytes by position
    (``fileno()``); :class:`CheckpointReadError` if it cannot be read now.  A file
    object, not a bare descriptor: one an interrupt leaves behind is closed when
    it is dropped."""
    try:
        # Opened inside FileIO's constructor, so no line runs between the open and the owner.
        f = io.FileIO(path, "r", opener=lambda p, _: os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)))
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            f.close()
            raise OSError(0, "it is no longer a regular file")
    except OSError as e:
        raise CheckpointReadError(f"cannot read {entry.describe()}: {e.strerror or e}.{_NOTHING_CHANGED}") from None
    if hasattr(os, "posix_fadvise"):
        # Exactly the bytes asked for: no readahead into a shard another rank reads.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
    return f


def open_regular(path: str, error=CheckpointError):
    """``path`` open for reading in binary, refused (``error``) unless it is a
    regular file: a FIFO would block forever, a device never ends.

    Example::

        >>> open_regular("/dev/zero")
        Traceback (most recent call last):
        ...
        deferinit.materialize.checkpoint.errors.CheckpointError: /dev/zero is a character device, not a regular file: ...
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
