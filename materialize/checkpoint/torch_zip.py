"""A ``torch.save`` zip archive, read through Python's :mod:`zipfile`.

The archive's central directory and each record's local header say where
its bytes are, whoever wrote the zip (``torch.save``, or a zip tool that
re-packed it): nothing assumes ``torch.save``'s own layout.  What
``torch.load`` (its C++ reader, built on miniz) refuses is refused here:
an archive whose central directory is not where its end record says, or
that spans disks, or holds encrypted or patched records; records stored
neither plainly nor with deflate; members outside the folder of the first
one; a missing or unsupported ``version``; a ``byteorder`` other than
``little`` or ``big``.  Record names are looked up without regard to ASCII
case, as miniz does, so two names equal but for case are refused (which
one ``torch.load`` reads is not defined).
"""

from __future__ import annotations

import re
import struct
import zipfile

# torch.load reads records of these format versions (caffe2/serialize/versions.h).
_VERSIONS = range(1, 11)
# data.pkl larger than this is refused: it is read into memory whole, as
# torch.load does, and run by a pure-Python unpickler at about a microsecond
# an opcode, each of which may push a value (a state dict takes about 130
# bytes a tensor: 64 MiB is half a million tensors).  A deflated record of
# that size fits in 64 KiB of file.
MAX_PICKLE = 64 << 20
# The other records torch.load reads (version, byteorder...) hold a few bytes.
MAX_SMALL_RECORD = 1 << 16
# zipfile keeps about 600 bytes a member (miniz, in torch.load, about 50): a
# directory of at most 64 MiB (half a million records) costs at most ~400 MiB.
MAX_DIRECTORY = 64 << 20
_LOWER = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", b"abcdefghijklmnopqrstuvwxyz")
_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")
_ENCRYPTED, _PATCHED, _STRONG, _MASKED = 0x1, 0x20, 0x40, 0x2000


class ArchiveError(ValueError):
    """What is wrong with an archive (the caller names the file)."""


def _raw_name(info: zipfile.ZipInfo) -> bytes:
    return info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")


class Archive:
    """The records of a ``torch.save`` archive open as ``f`` (``size`` bytes).

    Example::

        >>> import io
        >>> buffer = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, buffer)
        >>> archive = Archive(buffer, len(buffer.getvalue()))
        >>> archive.get("byteorder") is not None, archive.read("byteorder")
        (True, b'little')
    """

    def __init__(self, f, size: int):
        self.f = f
        self.size = size
        try:
            end = zipfile._EndRecData(f)
            if end and end[zipfile._ECD_SIZE] > MAX_DIRECTORY:
                raise ArchiveError(
                    f"its central directory has {end[zipfile._ECD_SIZE]} bytes (load_checkpoint reads at most "
                    f"{MAX_DIRECTORY})"
                )
            self.zip = zipfile.ZipFile(f)
            infos = self.zip.infolist()
        except ArchiveError:
            raise
        except Exception as e:  # noqa: BLE001 - zipfile raises many kinds on corrupt input
            raise ArchiveError(f"not a readable zip archive ({type(e).__name__}: {e})") from None
        self._check_directory(end, infos)
        self.records: dict[bytes, zipfile.ZipInfo] = {}
        for info in infos:
            raw = _raw_name(info)
            if b"\0" in raw:
                raise ArchiveError(f"a member's name holds a NUL byte: {raw[:60]!r}")
            key = raw.translate(_LOWER)
            if key in self.records:
                other = _raw_name(self.records[key])
                raise ArchiveError(
                    f"member {raw.decode(errors='replace')!r} is in it twice" if other == raw else
                    f"members {other.decode(errors='replace')!r} and {raw.decode(errors='replace')!r} differ only by case"
                )
            self.records[key] = info
        first = _raw_name(infos[0]) if infos else b""
        if b"/" not in first:
            raise ArchiveError(f"its first member {first.decode(errors='replace')!r} is not in a folder" if infos else "it has no members")
        self.prefix = first[: first.index(b"/") + 1]
        for info in infos:
            raw = _raw_name(info)
            if not raw.startswith(self.prefix):
                raise ArchiveError(f"member {info.orig_filename!r} is outside the folder {self.prefix.decode(errors='replace')!r}")
            # torch.load lists the names as Python strings, read from a 512-byte buffer
            try:
                name = raw[len(self.prefix):].decode("utf-8")
            except UnicodeDecodeError:
                raise ArchiveError(f"member {raw[:80]!r} has a name that is not UTF-8") from None
            if len(raw) > 511:
                raise ArchiveError(f"member {raw[:80]!r}... has a name of {len(raw)} bytes (torch.load reads 511)")
            if name == "constants.pkl":
                raise ArchiveError("it is a TorchScript archive (torch.jit.save), not a torch.save file")
        self._check_version()

    def _check_directory(self, end, infos) -> None:
        # miniz reads the central directory where the end record says and
        # counts its entries; zipfile forgives both.
        if not end or self.zip.start_dir != end[zipfile._ECD_OFFSET]:
            raise ArchiveError("its central directory is not where the end record says")
        fields = (zipfile._ECD_DISK_NUMBER, zipfile._ECD_DISK_START, zipfile._ECD_ENTRIES_THIS_DISK,
                  zipfile._ECD_ENTRIES_TOTAL, zipfile._ECD_SIZE, zipfile._ECD_OFFSET)
        if self._miniz_end(end[zipfile._ECD_LOCATION]) != tuple(end[i] for i in fields):
            raise ArchiveError("its end record and zip64 end record disagree")
        disks = (end[zipfile._ECD_DISK_NUMBER], end[zipfile._ECD_DISK_START])
        if disks not in ((0, 0), (1, 1)) or not end[zipfile._ECD_ENTRIES_THIS_DISK] == end[zipfile._ECD_ENTRIES_TOTAL] == len(infos):
            raise ArchiveError("its end record does not count the central directory's entries (or spans disks)")
        # miniz walks the entries by their declared lengths; zipfile reads past
        # a short directory's end quietly.
        self.f.seek(self.zip.start_dir)
        directory, at = self.f.read(end[zipfile._ECD_SIZE]), 0
        for _ in infos:
            n, m, k = struct.unpack("<3H", directory[at + 28:at + 34]) if len(directory) >= at + 46 else (0, 0, 0)
            if len(directory) < at + 46 or directory[at:at + 4] != b"PK\x01\x02" or at + 46 + n + m + k > len(directory):
                raise ArchiveError("its central directory is shorter than its entries")
            at += 46 + n + m + k
        for info in infos:
            if info.flag_bits & (_ENCRYPTED | _STRONG | _MASKED):
                raise ArchiveError(f"member {info.orig_filename!r} is encrypted")
            if info.volume not in (disks[0], 1) or info.volume == 0xFFFF:
                raise ArchiveError(f"member {info.orig_filename!r} is on another disk")
            stored = info.compress_type == zipfile.ZIP_STORED
            if (stored and info.compress_size != info.file_size) or (info.file_size and not info.compress_size):
                raise ArchiveError(f"member {info.orig_filename!r} has {info.compress_size} bytes for {info.file_size}")
            if info.header_offset + 30 + info.compress_size > self.size:
                raise ArchiveError(f"member {info.orig_filename!r} reaches past the end of the file")

    def _miniz_end(self, at: int) -> tuple:
        """(disk, directory disk, entries here, entries, directory size, directory
        offset) as miniz reads them: from the zip64 end record where the locator
        before the end record at ``at`` points, if there is one, else from the end
        record (zipfile reads the zip64 record just before the locator instead)."""
        self.f.seek(at)
        values = struct.unpack("<4x4H2L", self.f.read(20))
        if at < 76:
            return values
        self.f.seek(at - 20)
        sig, _, offset, disks = struct.unpack("<4sLQL", self.f.read(20))
        if sig != b"PK\x06\x07":
            return values
        if disks != 1 or offset > self.size - 56:
            raise ArchiveError("its zip64 end-record locator is damaged (or the archive spans disks)")
        self.f.seek(offset)
        record = self.f.read(56)
        if record[:4] != b"PK\x06\x06":
            return values
        size, disk, cd_disk, here, total, cd_size, cd_offset = struct.unpack("<Q4x2L4Q", record[4:56])
        if size < 44 or max(here, total, cd_size) > 0xFFFFFFFF:
            raise ArchiveError("its zip64 end record is damaged")
        return (disk, cd_disk, here, total, cd_size, cd_offset)

    def _check_version(self) -> None:
        info = self.get(".data/version") or self.get("version")
        if info is None:
            raise ArchiveError("it has no version record")
        # std::stoull: spaces, a sign (a minus wraps around), digits.
        match = re.match(rb"[ \t\n\v\f\r]*([+-]?)([0-9]+)", self.read(info))
        version = int(match.group(2)) if match else None
        if version is not None and match.group(1) == b"-":
            version = (-version) % 2**64 if version < 2**64 else None
        if version not in _VERSIONS:
            raise ArchiveError(f"its format version {self.read(info)[:20]!r} is not one torch.load reads")

    def get(self, name: str):
        """The member ``name`` of the archive's folder, or None."""
        return self.records.get((self.prefix + name.encode()).translate(_LOWER))

    def _open(self, info: zipfile.ZipInfo):
        if info.external_attr & 0x10 or info.orig_filename.endswith("/"):
            # miniz reads nothing for a directory: torch.load gets uninitialised memory
            raise ArchiveError(f"member {info.orig_filename!r} is marked as a directory")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ArchiveError(f"member {info.orig_filename!r} is compressed with method {info.compress_type}, which torch.load cannot read")
        if info.flag_bits & _PATCHED:
            raise ArchiveError(f"member {info.orig_filename!r} is compressed patched data")
        try:
            return self.zip.open(info)
        except Exception as e:  # noqa: BLE001
            raise ArchiveError(f"member {info.orig_filename!r}: {type(e).__name__}: {e}") from None

    def read(self, info, limit: int = MAX_SMALL_RECORD) -> bytes:
        """A record's bytes (decompressed, its CRC checked), refused beyond ``limit``."""
        if isinstance(info, str):
            name, info = info, self.get(info)
            if info is None:
                raise ArchiveError(f"it has no {name} record")
        if info.file_size > limit:
            raise ArchiveError(f"member {info.orig_filename!r} has {info.file_size} bytes (load_checkpoint reads at most {limit})")
        try:
            with self._open(info) as member:
                data = member.read()
        except ArchiveError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ArchiveError(f"member {info.orig_filename!r} cannot be read ({type(e).__name__}: {e})") from None
        if len(data) != info.file_size:  # zipfile stops where the deflate stream ends, miniz checks
            raise ArchiveError(f"member {info.orig_filename!r} inflates to {len(data)} bytes, not {info.file_size}")
        return data

    def position(self, info: zipfile.ZipInfo) -> int:
        """Where a stored record's bytes begin (after its local header), checked
        to lie in the file; a deflated record is decompressed once to check it."""
        if info.compress_type != zipfile.ZIP_STORED:
            done = 0
            try:
                with self._open(info) as member:
                    while chunk := member.read(1 << 24):
                        done += len(chunk)
            except ArchiveError:
                raise
            except Exception as e:  # noqa: BLE001
                raise ArchiveError(f"member {info.orig_filename!r} cannot be read ({type(e).__name__}: {e})") from None
            if done != info.file_size:
                raise ArchiveError(f"member {info.orig_filename!r} inflates to {done} bytes, not {info.file_size}")
            return 0
        self._open(info).close()  # its local header: signature and name
        self.f.seek(info.header_offset)
        header = _LOCAL_HEADER.unpack(self.f.read(_LOCAL_HEADER.size))
        start = info.header_offset + _LOCAL_HEADER.size + header[10] + header[11]
        if start + info.compress_size > self.size:
            raise ArchiveError(f"member {info.orig_filename!r} reaches past the end of the file")
        return start

    def check(self) -> bytes:
        """The records ``torch.load`` reads before the pickle, as it reads them;
        returns the byte order."""
        for name in (".data/serialization_id", ".format_version"):
            if self.get(name) is not None:
                self.read(name)
        alignment = self.get(".storage_alignment")
        if alignment is not None:
            try:
                int(self.read(alignment))
            except ValueError:
                raise ArchiveError(f"its .storage_alignment record {self.read(alignment)[:20]!r} is not a number") from None
        order = b"little"
        if self.get("byteorder") is not None:
            order = self.read("byteorder")
            if order not in (b"little", b"big"):
                raise ArchiveError(f"its byteorder record says {order[:20]!r}, neither 'little' nor 'big'")
        return order

    def pickle(self) -> bytes:
        info = self.get("data.pkl")
        if info is None:
            raise ArchiveError("it has no data.pkl record")
        return self.read(info, MAX_PICKLE)
