"""Zip surgery for the checkpoint fuzzer: re-zipping, patching a record in
place with its CRC fixed, and patching single fields of the central
directory, the local headers and the end record.

Example::

    >>> import io, zipfile
    >>> blob = rezip(["a/x", "a/y"], {"a/x": b"1234", "a/y": b"ab"})
    >>> zipfile.ZipFile(io.BytesIO(crc_patch(blob, "a/x", b"4321"))).read("a/x")
    b'4321'
"""

from __future__ import annotations

import io
import random
import struct
import warnings
import zipfile
import zlib

_CD = struct.Struct("<4s4B4HL2L5H2L")
# (name, offset, width) of the fields a mutation may change.
CD_FIELDS = [("signature", 0, 4), ("version needed", 6, 2), ("flags", 8, 2), ("method", 10, 2), ("crc", 16, 4),
             ("compressed size", 20, 4), ("size", 24, 4), ("name length", 28, 2), ("extra length", 30, 2),
             ("comment length", 32, 2), ("disk", 34, 2), ("local header offset", 42, 4)]
LOCAL_FIELDS = [("signature", 0, 4), ("flags", 6, 2), ("method", 8, 2), ("crc", 14, 4), ("compressed size", 18, 4),
                ("size", 22, 4), ("name length", 26, 2), ("extra length", 28, 2)]
END_FIELDS = [("signature", 0, 4), ("disk", 4, 2), ("directory disk", 6, 2), ("entries here", 8, 2),
              ("entries", 10, 2), ("directory size", 12, 4), ("directory offset", 16, 4), ("comment length", 20, 2)]


def rezip(names, records: dict, method: int = zipfile.ZIP_STORED) -> bytes:
    """An archive of ``records`` in the order of ``names`` (a name twice: two members),
    as ``zipfile`` writes it."""
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # duplicate names are on purpose
        with zipfile.ZipFile(buffer, "w", method) as z:
            for name in names:
                z.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), records[name], compress_type=method)
    return buffer.getvalue()


def _zip64_extra(extra: bytes, sizes: list) -> list:
    """``[size, compressed size, local header offset]`` with the zip64 extra field's values."""
    at = 0
    while at + 4 <= len(extra):
        tag, n = struct.unpack("<2H", extra[at:at + 4])
        if tag == 1:
            values, field = list(sizes), extra[at + 4:at + 4 + n]
            for i in range(3):
                if values[i] == 0xFFFFFFFF and len(field) >= 8:
                    values[i], field = struct.unpack("<Q", field[:8])[0], field[8:]
            return values
        at += 4 + n
    return sizes


def entries(blob: bytes):
    """``(offset of its central-directory entry, name, local header offset, flags, method, size)`` per member."""
    end = blob.rindex(b"PK\x05\x06")
    count, _, start = struct.unpack("<H2L", blob[end + 10:end + 20])
    if (count == 0xFFFF or start == 0xFFFFFFFF) and blob[end - 20:end - 16] == b"PK\x06\x07":
        record = struct.unpack("<Q", blob[end - 12:end - 4])[0]
        count, start = struct.unpack("<Q8xQ", blob[record + 32:record + 56])
    out, at = [], start
    for _ in range(count):
        fields = _CD.unpack(blob[at:at + _CD.size])
        if fields[0] != b"PK\x01\x02":
            raise ValueError(f"no central-directory entry at {at}")
        n, m, k = fields[12], fields[13], fields[14]
        size, _, local = _zip64_extra(blob[at + 46 + n:at + 46 + n + m], [fields[11], fields[10], fields[18]])
        out.append((at, blob[at + 46:at + 46 + n], local, fields[5], fields[6], size))
        at += 46 + n + m + k
    return out


def crc_patch(blob: bytes, name: str, data: bytes) -> bytes:
    """``blob`` with the stored member ``name`` holding ``data`` (same length), CRC fixed."""
    out = bytearray(blob)
    crc = struct.pack("<L", zlib.crc32(data) & 0xFFFFFFFF)
    try:
        members = entries(blob)
    except (ValueError, struct.error):  # a directory an earlier mutation broke
        members = []
    for cd, member, local, flags, method, size in members:
        if member != name.encode() or method != 0 or size != len(data):
            continue
        n, m = struct.unpack("<2H", blob[local + 26:local + 30])
        start = local + 30 + n + m
        out[start:start + len(data)] = data
        out[cd + 16:cd + 20] = crc
        if blob[local + 14:local + 18] != b"\0\0\0\0":
            out[local + 14:local + 18] = crc
        if flags & 0x8:  # a data descriptor follows the data
            at = start + len(data) + (4 if blob[start + len(data):start + len(data) + 4] == b"PK\x07\x08" else 0)
            out[at:at + 4] = crc
        return bytes(out)
    zf = zipfile.ZipFile(io.BytesIO(blob))
    names = [i.filename for i in zf.infolist()]
    records = {n: zf.read(n) for n in names}
    records[name] = data
    return rezip(names, records)


def _patch(blob: bytes, at: int, width: int, rng: random.Random) -> tuple[bytes, int, int]:
    old = int.from_bytes(blob[at:at + width], "little")
    top = 2 ** (8 * width) - 1
    new = rng.choice([old + 1, old - 1, old + 4, old - 4, old + 30, 0, top, top - 1, old ^ (1 << rng.randrange(8 * width)),
                      rng.randrange(top + 1)]) % (top + 1)
    return blob[:at] + new.to_bytes(width, "little") + blob[at + width:], old, new


def zip_fields(blob: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One field of the central directory, a local header or the end record changed."""
    try:
        members = entries(blob)
    except Exception:  # noqa: BLE001 - no end record to start from
        members = []
    where = rng.choice(["directory", "directory", "local", "end"]) if members else "end"
    if where == "end":
        if b"PK\x05\x06" not in blob:
            return blob[:-1], "no end record: truncated"
        base, fields, what = blob.rindex(b"PK\x05\x06"), END_FIELDS, "end record"
    else:
        cd, name, local, *_ = rng.choice(members)
        base = cd if where == "directory" else local
        fields = CD_FIELDS if where == "directory" else LOCAL_FIELDS
        what = f"{where} entry of {name.decode(errors='replace')}"
    field, offset, width = rng.choice(fields)
    if base + offset + width > len(blob):
        return blob, f"{what}: {field} out of the file"
    out, old, new = _patch(blob, base + offset, width, rng)
    return out, f"{what}: {field} {old} -> {new}"
