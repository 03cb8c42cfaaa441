"""A ``torch.save`` archive's tensors and where their bytes are, as torch's own loader reads them.

The archive (a file, or a chunk of a distributed checkpoint) is opened by
PyTorch's reader (``torch._C.PyTorchFileReader``: its zip directory,
``version``, records, as ``torch.load`` finds them) and loaded by
``torch.load``'s loader (``torch.serialization._load``) with
``map_location="meta"`` and the weights-only unpickler: it is refused where
``torch.load(weights_only=True)`` refuses it, and gives its tensors on meta
storages, each storage's record named.  Between the two:

* ``data.pkl`` passes the guard of :mod:`.pickle_scan` before the
  unpickler sees it;
* the loader is shown neither ``.format_version`` (it would compute the
  offsets of torch's own zip layout instead of asking the reader, wrong for
  a re-zipped archive) nor ``byteorder`` (byte-swapping a meta storage
  crashes the process): both are read as ``torch.load`` reads them, and
  the elements of a big-endian archive are swapped when they are read;
* every record the loader reads (``data.pkl``, ``byteorder``,
  ``.format_version``, ``.data/serialization_id``) is checked as storages'
  records are (below) before PyTorch's reader gives it: that reader checks
  no CRC and ignores a failed inflate, so a damaged deflated record, or a
  directory entry pointing at another record's header, would give
  uninitialised memory and a verdict that changes from run to run;
* a storage loaded twice is the first one, as ``torch.load``'s cache of CPU
  storages makes it, whatever size the second persistent id says; a record
  read with two dtypes is refused (torch versions disagree on it, and
  ``torch.save`` writes one dtype per record that holds bytes).

What ``torch.load`` checks only when it reads a record's bytes is checked
after: the record's size against its storage's.  A small record of an
archive held in memory (a small DCP chunk, read at once) is read by position
when PyTorch's reader gives the bytes found there; otherwise the
zip directory entry PyTorch's reader took for it (:mod:`zipfile` reads it
too) must say: a local header where the entry says, no encryption, the
bytes inside the file; a stored record is then read by position, a
deflated one inflated whole (checked now: exactly its size, or PyTorch's
reader would refuse it or give uninitialised memory).  A directory entry
is refused (``torch.load`` gives uninitialised memory for it), and so is a
tensor reaching past its record (the same).

Example::

    >>> import io
    >>> buffer = io.BytesIO()
    >>> torch.save({"w": torch.arange(6.0).reshape(2, 3)[:, 1:]}, buffer)
    >>> obj, records = read_archive(buffer)
    >>> [(k, t.device.type, tuple(t.shape), t.storage_offset()) for k, t in obj.items()]
    [('w', 'meta', (2, 2), 1)]
    >>> record = records[obj["w"].untyped_storage()._cdata]
    >>> record.name, record.nbytes, record.position > 0
    ('data/0', 24, True)
"""

from __future__ import annotations

import io
import sys
import zipfile
import zlib
from typing import NamedTuple

import torch
from torch import _weights_only_unpickler as weights_only

from deferinit.fake.extent import extent

from .pickle_scan import ScanError, guard

_ENCRYPTED_OR_PATCHED = 0x1 | 0x20 | 0x40 | 0x2000
# Records of at most this many bytes of an archive held in memory are compared
# with what PyTorch's reader gives; the others are found in the zip directory
# as zipfile reads it.  Only in memory: on a file the comparison would read
# every small record's bytes twice when the checkpoint is opened, not once
# when it is materialized (test_checkpoint_dcp_distributed.py counts them).
_SMALL = 1 << 16


class ArchiveError(ValueError):
    """What is wrong with an archive (the caller names the file)."""


class Record(NamedTuple):
    """A storage's record: ``position`` of its bytes in the file, or where it is
    ``deflated`` (start, length: inflated whole when read); ``nbytes``; ``unit``,
    the bytes reversed together when read (a big-endian archive; 1: none)."""

    name: str
    position: int | None
    deflated: tuple | None
    nbytes: int
    unit: int


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def open_reader(f):
    """PyTorch's reader of the archive ``f`` (a seekable binary file)."""
    f.seek(0)
    try:
        return torch._C.PyTorchFileReader(f)
    except Exception as e:  # noqa: BLE001 - whatever PyTorch's reader refuses, torch.load refuses
        raise ArchiveError(f"torch.load cannot open it ({_first_line(e)})") from None


class _Loader:
    """What ``torch.serialization._load`` is given as the archive's reader and as
    its pickle module (see the module's doc)."""

    def __init__(self, reader, check):
        self.reader = reader
        self.check = check  # a record's name -> refused unless PyTorch's reader reads it deterministically
        self.order = None
        self.first: dict = {}  # storage key -> the typed storage loaded first
        self.storages: dict = {}  # meta storage -> (record name, dtype, nbytes)
        loader = self

        class Unpickler(weights_only.Unpickler):
            @property
            def persistent_load(self):
                return self._persistent_load

            @persistent_load.setter
            def persistent_load(self, load):
                self._persistent_load = lambda saved_id: loader.storage(load, saved_id)

        self.Unpickler = Unpickler

    def storage(self, load, saved_id):
        typed = load(saved_id)  # torch's own checks of the persistent id
        storage_type, key, _, numel = saved_id[1:5]
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        first = self.first.get(key)
        if first is not None and first.dtype != dtype and (first._untyped_storage.nbytes() or numel):
            # torch.save writes one dtype per record that holds bytes.  torch 2.13
            # gives the first reference's storage, 2.15 reinterprets it or, when
            # the sizes differ, refuses ("record size ... does not match expected
            # size"): no answer both give, so refused.
            raise ArchiveError(
                f"record 'data/{key}' is read as {first.dtype} ({first._untyped_storage.nbytes()} bytes) and as "
                f"{dtype} ({numel} element{'' if numel == 1 else 's'}): torch.save writes one dtype per record"
            )
        if first is not None and first._untyped_storage.nbytes():
            return first
        self.first[key] = typed
        self.storages[typed._untyped_storage._cdata] = (f"data/{key}", dtype, typed._untyped_storage.nbytes())
        return typed

    def has_record(self, name: str) -> bool:
        if name == ".format_version":
            if self.reader.has_record(name):
                self.check(name)
                self.reader.get_record(name)
            return False
        if name == "byteorder":
            if self.reader.has_record(name):
                self.check(name)
                self.order = self.reader.get_record(name)
                if self.order not in (b"little", b"big"):
                    raise ArchiveError(f"its byteorder record says {self.order[:20]!r}, neither 'little' nor 'big'")
            return False
        return self.reader.has_record(name)

    def get_record(self, name: str):
        self.check(name)
        data = self.reader.get_record(name)
        if name == "data.pkl":
            try:
                guard(data)
            except ScanError as e:
                raise ArchiveError(str(e)) from None
        return data

    def get_record_offset(self, name: str) -> int:
        return self.reader.get_record_offset(name)

    def serialization_id(self) -> str:
        if self.reader.has_record(".data/serialization_id"):
            self.check(".data/serialization_id")
        return self.reader.serialization_id()


def _record_size(reader, name: str) -> int:
    """The size PyTorch's reader gives the record ``name``."""
    try:
        return reader.get_record_size(name)
    except Exception as e:  # noqa: BLE001 - whatever PyTorch's reader refuses, torch.load refuses
        raise ArchiveError(f"torch.load cannot read its record {name!r} ({_first_line(e)})") from None


def _byte_order() -> bytes:
    """What ``torch.load`` takes for an archive without a ``byteorder`` record."""
    Endianness = torch.serialization.LoadEndianness
    default = torch.serialization.get_default_load_endianness()
    return {Endianness.BIG: b"big", Endianness.NATIVE: sys.byteorder.encode()}.get(default, b"little")


def read_archive(f) -> tuple:
    """``(object, {meta storage: Record})`` of the archive open as ``f`` (a seekable
    binary file, its position anywhere): the object as ``torch.load(f,
    map_location="meta", weights_only=True)`` gives it."""
    reader = open_reader(f)
    try:
        names = reader.get_all_records()
    except Exception as e:  # noqa: BLE001 - a name that is not UTF-8: torch.load fails listing them too
        raise ArchiveError(f"torch.load cannot list its records ({_first_line(e)})") from None
    if "constants.pkl" in names:
        raise ArchiveError("it is a TorchScript archive (torch.jit.save), which torch.load(weights_only=True) refuses")
    if sys.byteorder != "little" or _byte_order() == b"big":
        # The loader, shown no byteorder record, would byte-swap meta storages.
        raise ArchiveError(
            "load_checkpoint reads archives on a little-endian machine, with torch.load's default byte order "
            "(torch.serialization.set_default_load_endianness changed it)"
        )
    size = f.seek(0, 2)
    read: list = []

    def directory() -> dict:
        if not read:
            read.append(_directory(f))
        return read[0]

    def check(name: str) -> None:
        # PyTorch's reader checks no CRC and ignores a failed inflate: a deflated
        # record that does not inflate to its size, or a directory entry pointing
        # at another record's header, gives uninitialised memory (torch.load's
        # verdict then changes from run to run); _locate refuses both.
        _locate(f, size, reader, directory, name, _record_size(reader, name))

    loader = _Loader(reader, check)
    tls = torch.serialization._serialization_tls
    before = tls.map_location
    try:
        obj = torch.serialization._load(loader, "meta", loader, encoding="utf-8")
    except ArchiveError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever torch.load's loader raises, it refuses
        raise ArchiveError(f"torch.load(weights_only=True) refuses it ({_first_line(e)})") from None
    finally:
        tls.map_location = before  # the loader leaves it set when it raises
    order = loader.order or _byte_order()
    records = _records(f, size, reader, directory, loader.storages, order != sys.byteorder.encode())
    return obj, records


def _directory(f) -> dict:
    """``local header offset -> [ZipInfo]`` of the zip directory as zipfile reads it
    (empty where it cannot)."""
    by_offset: dict = {}
    try:
        f.seek(0)
        for info in zipfile.ZipFile(f).infolist():
            by_offset.setdefault(info.header_offset, []).append(info)
    except Exception:  # noqa: BLE001 - zipfile refuses what PyTorch's reader reads: see _locate
        pass
    return by_offset


def _locate(f, size: int, reader, directory, name: str, nbytes: int) -> tuple:
    """``(position, deflated)`` of the record ``name``: where its stored bytes begin,
    or ``(None, (start, compressed size))`` for a deflated one (checked now: it
    inflates to exactly its size, as PyTorch's reader requires).  ``directory()``
    gives :func:`_directory`'s."""
    header, start = reader.get_record_header_offset(name), reader.get_record_offset(name)
    if nbytes <= _SMALL and isinstance(f, io.BytesIO):
        # Small and in memory: by position if PyTorch's reader gives the bytes found there.
        try:
            data = reader.get_record(name)
        except Exception as e:  # noqa: BLE001
            raise ArchiveError(f"torch.load cannot read its record {name!r} ({_first_line(e)})") from None
        f.seek(start)
        if f.read(nbytes) == data:
            return start, None
    # The directory entry PyTorch's reader took for the record: the one at its local header.
    found = [i for i in directory().get(header, ()) if i.file_size == nbytes
             and i.filename.split("/", 1)[-1].lower() == name.lower()]
    f.seek(header)
    signature = f.read(4)
    if len(found) != 1:
        raise ArchiveError(f"its record {name!r} is not where zipfile and PyTorch's reader both find it")
    info = found[0]
    if info.is_dir() or info.external_attr & 0x10:
        raise ArchiveError(f"record {name!r} is a directory entry (torch.load gives uninitialised memory for it)")
    if info.flag_bits & _ENCRYPTED_OR_PATCHED or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise ArchiveError(f"record {name!r} is encrypted or compressed with method {info.compress_type}, which torch.load refuses")
    if signature != b"PK\x03\x04":
        raise ArchiveError(f"record {name!r} has no local header where the zip directory says")
    if start + info.compress_size > size:
        raise ArchiveError(f"record {name!r} reaches byte {start + info.compress_size} of a file of {size}")
    if info.compress_type == zipfile.ZIP_STORED:
        return start, None
    inflate(f, start, info.compress_size, nbytes, name)
    return None, (start, info.compress_size)


def inflate(f, start: int, length: int, nbytes: int, name: str) -> bytes:
    """The record ``name`` deflated at ``[start, start + length)`` of ``f``: exactly
    ``nbytes`` bytes and the end of the stream, else :class:`ArchiveError` (PyTorch's
    reader refuses it, or gives uninitialised memory)."""
    f.seek(start)
    inflater = zlib.decompressobj(-zlib.MAX_WBITS)
    try:
        data = inflater.decompress(f.read(length), nbytes + 1)
    except zlib.error as e:
        raise ArchiveError(f"record {name!r} does not inflate ({e})") from None
    if len(data) != nbytes or not inflater.eof:
        raise ArchiveError(f"record {name!r} does not inflate to its {nbytes} bytes")
    return data


def _swap_unit(dtype: torch.dtype) -> int:
    """The bytes ``torch.load`` reverses together (``UntypedStorage.byteswap``: a
    complex number's halves apart)."""
    size = torch._utils._element_size(dtype)
    return max(size // 2, 1) if dtype.is_complex else size


def _records(f, size: int, reader, directory, storages: dict, swap: bool) -> dict:
    found, out = {}, {}
    for cdata, (name, dtype, nbytes) in storages.items():
        if name not in found:
            stored = _record_size(reader, name)
            if stored != nbytes:
                raise ArchiveError(f"record {name!r} has {stored} bytes, its pickle says {nbytes}")
            found[name] = _locate(f, size, reader, directory, name, nbytes)
        out[cdata] = Record(name, *found[name], nbytes, _swap_unit(dtype) if swap else 1)
    return out


def layout(t, records: dict, what: str) -> tuple:
    """``(Record, storage offset, strides)`` of the meta tensor ``t`` of an archive
    (``records`` from :func:`read_archive`), refused unless it is a dense tensor
    inside its record."""
    T = torch.Tensor  # through the class: a pickle can set attributes that shadow methods
    dense = type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and t.is_meta
    record = records.get(T.untyped_storage(t)._cdata) if dense else None
    if record is None:
        raise ArchiveError(f"{what} is not a dense tensor stored in the archive")
    if T.is_conj(t) or T.is_neg(t):
        raise ArchiveError(f"{what} is saved as a conjugate or negative view, which load_checkpoint does not read")
    offset, strides, itemsize = T.storage_offset(t), T.stride(t), t.dtype.itemsize
    if record.unit > 1 and record.unit != itemsize and not (t.dtype.is_complex and 2 * record.unit == itemsize):
        raise ArchiveError(f"{what} is {t.dtype} over a big-endian storage of {record.unit}-byte elements")
    end = extent(t.shape, strides, offset) * itemsize  # 0 for a zero-size tensor: it reads nothing
    if end > record.nbytes:
        raise ArchiveError(
            f"{what} ({list(t.shape)}, strides {list(strides)}, offset {offset}) reaches byte {end} of its "
            f"record, which has {record.nbytes} (torch.load gives uninitialised memory there)"
        )
    return record, offset, strides
