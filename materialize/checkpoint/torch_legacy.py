"""A legacy ``torch.save`` file, read without ``torch.load``.

Files saved with ``_use_new_zipfile_serialization=False`` (the format before
PyTorch 1.6, still written by some tools) are five pickles followed by the
storages' bytes: a magic number, the protocol version (1001), system
information, the object (its storages as persistent ids ``("storage",
type, key, location, element count, view)``), and the list of storage
keys; then, for each key of that list in order, its element count (8 bytes,
little-endian) and its bytes.

``torch.load`` allocates every storage at the size the pickle says, and a
tensor's ``set_`` grows its storage (copying it) to whatever size the pickle
asks, before a byte of data is read: a file of a few hundred bytes makes it
take gigabytes.  Here nothing is allocated: the pickles are read by PyTorch's
weights-only unpickler onto meta storages (:mod:`.torch_pickle`, which
checks every ``set_`` and refuses what would crash the unpickler), each
storage's bytes are found by walking the records as ``torch.load`` reads them,
their count checked, and the tensors are later read by position, as those
of a zip archive.  What ``torch.load(weights_only=True)`` refuses is refused
(the older tar format included), and so are storage views (files from
before PyTorch 0.4) and storages no record gives bytes to (``torch.load``
leaves them uninitialised).
"""

from __future__ import annotations

import tarfile

import torch

from .torch_pickle import PickleError, StorageRecord, load_pickle, short

MAGIC = 0x1950A86A20F9469CFC6C
PROTOCOL = 1001
# The magic number, protocol and system information are small pickles.
_SMALL = 1 << 16
_U64 = 2**64


class _LegacyStorages:
    """``persistent_load`` as ``torch.serialization._legacy_load`` does it, onto meta storages."""

    def __init__(self):
        self.by_key: dict = {}
        self.records: dict[int, StorageRecord] = {}

    def _new(self, key, dtype, nbytes: int):
        storage = torch.UntypedStorage(nbytes, device="meta")
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
        self.records[storage._cdata] = StorageRecord(key, None, dtype, nbytes, storage)
        return typed

    def persistent_load(self, saved_id):
        if type(saved_id) is not tuple or len(saved_id) != 6:
            raise PickleError(f"a persistent id is {type(saved_id).__name__} {short(saved_id)}, not a storage")
        storage_type, key, location, numel, view = saved_id[1:]
        if view is not None:
            raise PickleError(
                "it holds storage views (a file from before PyTorch 0.4), which load_checkpoint does not "
                "read; load it with torch.load and save it again"
            )
        if not isinstance(storage_type, torch.serialization.StorageType):
            raise PickleError(f"a storage has type {short(storage_type)}, not a storage type torch.load reads")
        torch.serialization._maybe_decode_ascii(location)
        dtype = storage_type.dtype
        nbytes = numel * torch._utils._element_size(dtype)
        if type(nbytes) is not int or nbytes < 0:
            raise PickleError(f"storage {short(key)} has {short(numel)} elements")
        typed = self.by_key.get(key)
        if typed is None:
            typed = self.by_key[key] = self._new(key, dtype, nbytes)
        elif typed._untyped_storage.nbytes() == 0:
            # torch.load gives a fresh empty storage for a key whose storage is empty
            return self._new(key, dtype, 0)
        return typed


def _refuse_tar(f) -> None:
    """``torch.load`` first tries the file as the older tar format, which it
    refuses with ``weights_only=True``."""
    f.seek(0)
    try:
        with tarfile.open(fileobj=f, mode="r:", format=tarfile.PAX_FORMAT):
            pass
    except tarfile.TarError:
        return
    except Exception as e:  # noqa: BLE001 - tarfile fails in other ways on some headers; so does torch.load
        raise PickleError(f"torch.load would fail reading it as a tar archive ({type(e).__name__}: {e})") from None
    raise PickleError("it is a tar archive (torch.save's format before PyTorch 0.2), which torch.load(weights_only=True) refuses")


def parse_legacy(f, size: int):
    """``(object, {storage id: StorageRecord})`` of the legacy file open as ``f``
    (``size`` bytes); each record's ``info`` is ``(None, position of its bytes)``.

    Example::

        >>> import io
        >>> buffer = io.BytesIO()
        >>> torch.save({"w": torch.arange(3.0)}, buffer, _use_new_zipfile_serialization=False)
        >>> obj, records = parse_legacy(buffer, len(buffer.getvalue()))
        >>> obj["w"].device, [r.info for r in records.values()] == [(None, len(buffer.getvalue()) - 12)]
        (device(type='meta'), True)
    """
    _refuse_tar(f)
    f.seek(0)
    if load_pickle(f, size, limit=_SMALL) != MAGIC:
        raise PickleError("it does not begin with torch.save's magic number")
    if load_pickle(f, size, limit=_SMALL) != PROTOCOL:
        raise PickleError(f"its protocol version is not {PROTOCOL}")
    load_pickle(f, size, limit=_SMALL)
    storages = _LegacyStorages()
    obj = load_pickle(f, size, storages.persistent_load)
    keys = load_pickle(f, size)
    if type(keys) is not list:
        raise PickleError(f"its list of storages is a {type(keys).__name__}")
    at = f.tell()
    for key in keys:
        try:
            typed = storages.by_key.get(key)
        except TypeError:
            typed = None
        if typed is None:
            raise PickleError(f"its list of storages names {short(key)}, which its pickle does not")
        record = storages.records[typed._untyped_storage._cdata]
        f.seek(at)
        head = f.read(8)
        if len(head) < 8:
            raise PickleError(f"it ends at byte {size}, before the bytes of storage {short(key)}")
        count = int.from_bytes(head, "little", signed=True)
        # torch.load multiplies in 64 bits, unsigned, and reads the storage's own size
        if (count * torch._utils._element_size(record.dtype)) % _U64 != record.nbytes:
            raise PickleError(f"storage {short(key)} has {count} elements in the file, its pickle says {record.nbytes} bytes")
        if at + 8 + record.nbytes > size:
            raise PickleError(f"it is truncated: storage {short(key)} ends at byte {at + 8 + record.nbytes}, the file has {size}")
        record.info = (None, at + 8)
        at += 8 + record.nbytes
    for record in storages.records.values():
        if record.info is None and record.nbytes:
            raise PickleError(f"storage {short(record.name)} has no bytes in it (torch.load would leave it uninitialised)")
    return obj, storages.records
