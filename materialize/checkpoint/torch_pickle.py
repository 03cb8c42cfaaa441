"""The pickle of a ``torch.save`` archive, read without data and without trust.

PyTorch's own weights-only unpickler (``torch._weights_only_unpickler``,
what ``torch.load(weights_only=True)`` runs) reads the pickle, so it calls
nothing outside its allowlist, and refuses what ``torch.load`` refuses.
Each storage it asks for becomes a meta storage of the size the pickle
says, once its record is found and its length checked (``torch.load``
refuses a record of another length too).  Tensors are built on those meta
storages by PyTorch's rebuild functions, whose ``set_`` is checked first
(a torch-function mode): offsets, sizes and strides non-negative, in int64,
and inside the storage.  On a CPU storage ``set_`` would instead grow the
storage, so ``torch.load`` gives uninitialised memory for a tensor reaching
past its record; such a file is refused.

The pickle is first walked (:mod:`.pickle_scan`): one that would crash
the unpickler is refused, and so are the globals it names that a state
dict does not need: besides those, the allowlist has sparse,
quantized, nested and wrapper-subclass rebuilds and legacy tensor classes
that build CPU tensors; those are refused, since ``load_checkpoint`` reads
dense tensors stored in the archive.
"""

from __future__ import annotations

import io
import reprlib
import math
import operator

import torch
from torch import _weights_only_unpickler as weights_only
from torch.overrides import TorchFunctionMode

from .pickle_scan import NeedMore, ScanError, scan
from .torch_zip import MAX_PICKLE, ArchiveError

_I64 = 2**63 - 1
_REFUSED_FUNCTIONS = (
    "_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor",
    "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
)


class PickleError(ValueError):
    """What is wrong with an archive's pickle (the caller names the file)."""


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 40, 40, 40
_SHORT.maxtuple = _SHORT.maxlist = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = 4


def short(value) -> str:
    """``value`` for an error message, in bounded work: a pickle's lists may
    share themselves through its memo, so that ``str`` would never return.

    Example::

        >>> nested = []
        >>> for _ in range(100):
        ...     nested = [nested, nested]
        >>> short(nested)
        '[[[...], [...]], [[...], [...]]]'
    """
    return _SHORT.repr(value)


def _allowed_globals() -> set:
    refused = {f"torch._utils.{name}" for name in _REFUSED_FUNCTIONS}
    refused.add("torch.serialization._get_layout")
    refused.update(f"{c.__module__}.{c.__name__}" for c in torch._tensor_classes)
    names = set(weights_only._get_allowed_globals()) | set(weights_only._get_user_allowed_globals())
    return names - refused


class StorageRecord:
    """A storage of the archive: its record, dtype (as pickled) and size."""

    __slots__ = ("name", "info", "dtype", "nbytes", "storage")

    def __init__(self, name, info, dtype, nbytes, storage):
        self.name, self.info, self.dtype, self.nbytes, self.storage = name, info, dtype, nbytes, storage

    def swap_unit(self) -> int:
        """The bytes ``torch.load`` reverses together in a big-endian archive
        (``UntypedStorage.byteswap``: a complex number's halves apart)."""
        size = torch._utils._element_size(self.dtype)
        return max(size // 2, 1) if self.dtype.is_complex else size


class _Storages:
    """``persistent_load``, as ``torch.serialization._load`` does it, onto meta storages."""

    def __init__(self, lookup):
        self.lookup = lookup
        self.by_key: dict = {}
        self.records: dict[int, StorageRecord] = {}

    def persistent_load(self, saved_id):
        if not isinstance(saved_id, tuple) or len(saved_id) != 5:
            raise PickleError(f"a persistent id is {type(saved_id).__name__} {short(saved_id)}, not a storage")
        if torch.serialization._maybe_decode_ascii(saved_id[0]) != "storage":
            raise PickleError(f"a persistent id names {short(saved_id[0])}, not a storage")
        storage_type, key, location, numel = saved_id[1:]
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if key in self.by_key:  # torch.load reuses a storage it read, whatever else the id says
            return self.by_key[key]
        nbytes = numel * torch._utils._element_size(dtype)
        if type(nbytes) is not int or nbytes < 0:
            raise PickleError(f"storage {short(key)} has {short(numel)} elements")
        torch.serialization._maybe_decode_ascii(location)
        name = f"data/{key}"
        info = self.lookup(name, nbytes)
        storage = torch.UntypedStorage(nbytes, device="meta")
        typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
        if nbytes:  # torch.load keeps storages whose data pointer is not null
            self.by_key[key] = typed
        self.records[storage._cdata] = StorageRecord(name, info, dtype, nbytes, storage)
        return typed


def _index(value, what: str) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise PickleError(f"{what} is {type(value).__name__}, not an integer") from None
    if not 0 <= value <= _I64:
        raise PickleError(f"{what} is {value}")
    return value


def check_geometry(offset, sizes, strides, itemsize: int, nbytes: int, what: str) -> None:
    """The elements of ``(offset, sizes, strides)`` lie in ``nbytes`` bytes
    (``strides`` empty: contiguous)."""
    offset = _index(offset, f"{what}'s storage offset")
    sizes = [_index(n, f"a size of {what}") for n in sizes]
    if strides:
        if len(strides) != len(sizes):
            raise PickleError(f"{what} has {len(sizes)} sizes and {len(strides)} strides")
        strides = [_index(s, f"a stride of {what}") for s in strides]
    else:
        strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    numel = math.prod(sizes)
    if numel > _I64:
        raise PickleError(f"{what} has {numel} elements")
    if numel:
        end = (offset + sum((n - 1) * s for n, s in zip(sizes, strides)) + 1) * itemsize
        if end > nbytes:
            raise PickleError(
                f"{what} ({sizes}, strides {strides}, offset {offset}) reaches byte {end} of its storage "
                f"record, which has {nbytes}"
            )


def _storage_nbytes(source) -> int:
    if isinstance(source, torch.Tensor):
        source = source.untyped_storage()
    if isinstance(source, torch.storage.TypedStorage):
        source = source._untyped_storage
    return source.nbytes()


class _CheckedSet(TorchFunctionMode):
    """``Tensor.set_`` with a geometry reaches PyTorch only inside its storage."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.set_:
            values = dict(zip(("source", "storage_offset", "size", "stride"), args[1:]), **kwargs)
            if "size" in values:
                nbytes = _storage_nbytes(values["source"])
                check_geometry(values.get("storage_offset", 0), values["size"], values.get("stride", ()),
                               args[0].dtype.itemsize, nbytes, "a tensor")
        return func(*args, **kwargs)


def unpickle(data: bytes, lookup):
    """``(object, {storage id: StorageRecord})`` of the pickle ``data``; ``lookup(name,
    nbytes)`` checks a storage's record and returns it.

    Example::

        >>> import io, zipfile
        >>> buffer = io.BytesIO()
        >>> torch.save({"w": torch.ones(2, 3)}, buffer)
        >>> pkl = next(n for n in zipfile.ZipFile(buffer).namelist() if n.endswith("data.pkl"))
        >>> obj, records = unpickle(zipfile.ZipFile(buffer).read(pkl), lambda name, nbytes: name)
        >>> obj["w"].shape, obj["w"].device, [r.name for r in records.values()]
        (torch.Size([2, 3]), device(type='meta'), ['data/0'])
    """
    storages = _Storages(lookup)
    obj = load_pickle(io.BytesIO(data), len(data), storages.persistent_load)
    return obj, storages.records


def load_pickle(f, end: int, persistent_load=None, limit: int = MAX_PICKLE):
    """The object of the pickle at ``f``'s position (``f`` is left after it; the
    file ends at ``end``), read by the weights-only unpickler once
    :func:`.pickle_scan.scan` found it safe to run; its storages are given by
    ``persistent_load`` (None: it may have none), every ``set_`` is checked."""
    start = f.tell()
    most = min(limit, end - start)
    size = min(1 << 20, most)
    while True:
        f.seek(start)
        data = f.read(size)
        try:
            names, stop = scan(data)
            break
        except NeedMore:
            if size < most and len(data) == size:
                size = min(4 * size, most)
                continue
            if most == limit and end - start > limit:
                raise PickleError(f"its pickle is longer than {limit} bytes (load_checkpoint reads at most that)") from None
            raise PickleError("its pickle ends before its STOP opcode") from None
        except ScanError as e:
            raise PickleError(str(e)) from None
    unknown = sorted(names - _allowed_globals())
    if unknown:
        raise PickleError(
            f"its pickle uses {', '.join(unknown[:3])}: load_checkpoint reads dense tensors stored in the "
            "archive, under the globals torch.load(weights_only=True) allows"
        )
    f.seek(start + stop)
    unpickler = weights_only.Unpickler(io.BytesIO(data[:stop]), encoding="utf-8")
    if persistent_load is not None:
        unpickler.persistent_load = persistent_load
    try:
        with _CheckedSet():
            return unpickler.load()
    except Exception as e:  # noqa: BLE001
        if isinstance(e, (PickleError, ArchiveError)):
            raise
        raise PickleError(f"torch.load(weights_only=True) would refuse its pickle ({type(e).__name__}: {str(e)[:300]})") from None
