"""What PyTorch's archive reader requires of a ``torch.save`` zip, checked with ``zipfile``.

``torch.load`` reads archives with PyTorch's ``PyTorchStreamReader``
(miniz), which refuses things Python's ``zipfile`` lets pass: records
outside the archive's directory, a directory count that disagrees with
the end records, multi-disk fields, flags it does not support, a missing
or unknown ``version`` record.  A reader that reads by position must refuse
them too, or it would load archives ``torch.load`` refuses.  Here
``zipfile`` parses the directory, and :func:`check_archive` adds the rules
of PyTorch's reader found by mutating real archives: the end record and the
zip64 end record and locator torch writes (one disk, the same counts, the
same directory extent, no comment), every record under the first record's
directory, stored uncompressed, with supported flags and a local header that
matches the directory and ends before the directory starts.

Example::

    >>> archive = zipfile.ZipFile(window)           # a file object over the archive
    >>> records = check_archive(window, archive, bad)
    >>> data_start(window, records["archive/data/0"], bad)
    640
"""

from __future__ import annotations

import re
import struct
import zipfile

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader
_END = struct.Struct("<4s4H2LH")  # zipfile.structEndArchive
_LOCATOR = struct.Struct("<4sLQL")  # zipfile.structEndArchive64Locator
_END64 = struct.Struct("<4sQ2H2L4Q")  # zipfile.structEndArchive64
# Flags PyTorch's writer sets (sizes after the data) and UTF-8 names; any other is refused.
_FLAGS = 0x08 | 0x800
# The archive format versions PyTorch 2.13 reads (caffe2/serialize/versions.h).
VERSIONS = (1, 10)


def check_archive(file, archive: zipfile.ZipFile, bad) -> dict:
    """Check the whole archive (``archive`` parsed from the seekable ``file``);
    ``bad(why)`` makes the exception to raise.  Returns the records by name."""
    records = archive.infolist()
    if not records or "/" not in records[0].filename:
        raise bad("is not a torch.save archive (its records are not in one directory)")
    directory = _ends(file, len(records), bad)
    prefix = records[0].filename.split("/", 1)[0] + "/"
    names = set()
    for info in records:
        if not info.filename.startswith(prefix):
            raise bad(f"has a record {info.filename!r} outside the archive's directory {prefix!r}")
        if info.filename in names:
            raise bad(f"has two records named {info.filename!r}")
        names.add(info.filename)
        if info.volume:
            raise bad(f"puts its record {info.filename} on another disk")
        if data_start(file, info, bad) + info.compress_size > directory:
            raise bad(f"has a record {info.filename} that runs into its directory")
    found = {info.filename: info for info in records}
    version = found.get(prefix + "version", found.get(prefix + ".data/version"))
    if version is None:
        raise bad("has no version record")
    text = member(file, version, 64, bad)
    number = re.match(rb"\s*([+-]?\d+)", text)
    if number is None or not VERSIONS[0] <= int(number.group(1)) <= VERSIONS[1]:
        raise bad(f"has format version {text!r}; PyTorch reads versions {VERSIONS[0]} to {VERSIONS[1]}")
    return found


def _ends(file, count: int, bad) -> int:
    """Check the end record (and the zip64 ones when present); returns where the directory starts."""
    file.seek(0, 2)
    size = file.tell()
    if size < _END.size:
        raise bad("is too short for a zip archive")
    file.seek(size - _END.size)
    end = file.read(_END.size)
    if end[:4] != zipfile.stringEndArchive:
        raise bad("does not end with a zip end record (a comment, or bytes after it)")
    _, disk, first_disk, here, total, cd_size, cd_offset, comment = _END.unpack(end)
    if disk or first_disk or comment:
        raise bad("has a multi-disk or commented zip end record")
    if here != total or (total != 0xFFFF and total != count):
        raise bad(f"has a zip end record for {total} records where its directory lists {count}")
    at = size - _END.size - _LOCATOR.size
    if at >= 0:
        file.seek(at)
        locator = file.read(_LOCATOR.size)
        if locator[:4] == zipfile.stringEndArchive64Locator:
            _, z64_disk, z64_offset, disks = _LOCATOR.unpack(locator)
            if z64_disk or disks != 1 or z64_offset != at - _END64.size:
                raise bad("has a zip64 end locator that does not point to the record before it")
            file.seek(z64_offset)
            fields = _END64.unpack(file.read(_END64.size))
            sig, record_size, _, _, disk64, first64, here64, total64, size64, offset64 = fields
            if sig != zipfile.stringEndArchive64 or record_size != _END64.size - 12 or disk64 or first64:
                raise bad("has a corrupt zip64 end record")
            if here64 != total64 or total64 != count:
                raise bad(f"has a zip64 end record for {total64} records where its directory lists {count}")
            for short, long in ((cd_size, size64), (cd_offset, offset64)):
                if short != 0xFFFFFFFF and short != long:
                    raise bad("has zip end records that disagree on where its directory is")
            cd_size, cd_offset = size64, offset64
    return cd_offset


def data_start(file, info: zipfile.ZipInfo, bad) -> int:
    """Where a stored record's bytes start, from its local header (checked
    against the directory: name, flags, method)."""
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size or info.flag_bits & ~_FLAGS:
        raise bad(f"has its record {info.filename} compressed, encrypted or flagged {info.flag_bits:#x}")
    file.seek(info.header_offset)
    raw = file.read(_LOCAL_HEADER.size)
    if len(raw) != _LOCAL_HEADER.size:
        raise bad(f"ends inside the local header of {info.filename}")
    fields = _LOCAL_HEADER.unpack(raw)
    flags, method, name_length, extra_length = fields[3], fields[4], fields[10], fields[11]
    if (
        fields[0] != zipfile.stringFileHeader
        or flags & ~_FLAGS
        or method != zipfile.ZIP_STORED
        or file.read(name_length) != info.orig_filename.encode()
    ):
        raise bad(f"has a local header for {info.filename} that does not match its directory")
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def member(file, info: zipfile.ZipInfo, limit: int, bad) -> bytes:
    """A small stored record's bytes (at most ``limit``)."""
    if info.file_size > limit:
        raise bad(f"has a {info.file_size}-byte {info.filename} record")
    file.seek(data_start(file, info, bad))
    data = file.read(info.file_size)
    if len(data) != info.file_size:
        raise bad(f"ends inside its {info.filename} record")
    return data
