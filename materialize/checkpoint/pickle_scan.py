"""The one guard every checkpoint pickle passes before an unpickler sees it.

A ``torch.save`` archive's ``data.pkl`` (a file, or a chunk of a
distributed checkpoint) and a distributed checkpoint's ``.metadata`` are
walked opcode by opcode (:func:`guard`), following what the unpickler's
stack would hold as far as the nesting of tuples goes, and the globals
they name are checked against one restricted set (:func:`allowed`): what
``torch.load(weights_only=True)`` allows for dense tensors, and the
classes of PyTorch's DCP metadata.  Refused:

* a tuple nested a few hundred thousand deep (a megabyte of ``TUPLE1``
  opcodes), which crashes the process (SIGSEGV) as soon as it is hashed
  (a dict key, a storage key, a ``MetadataIndex``): CPython hashes tuples
  recursively with no depth check;
* a tuple holding another twice, sixty times over (``t = (t, t)`` through
  the memo, a few hundred bytes), which takes 2**60 steps to hash;
* an opcode outside protocol 2 to 4's plain values, or a global outside
  the set (sparse, quantized, nested and wrapper-subclass rebuilds and
  legacy tensor classes too: ``load_checkpoint`` reads dense tensors).

Example::

    >>> data = pickle.dumps({"w": (1, 2)}, protocol=2)
    >>> guard(data)
    >>> guard(b"\\x80\\x02}" + b")" + b"\\x85" * 5000 + b"Ns.")
    Traceback (most recent call last):
    ...
    deferinit.materialize.checkpoint.pickle_scan.ScanError: it nests tuples more than 1000 deep ...
"""

from __future__ import annotations

import pathlib
import pickle
import reprlib

import torch
from torch import _weights_only_unpickler as weights_only

# A pickle longer than this is refused: the unpickler holds it whole, and
# torch's runs at about a microsecond an opcode (a state dict takes about 130
# bytes a tensor: 64 MiB is half a million tensors).
MAX_PICKLE = 64 << 20
# Deeper tuples are refused (real checkpoints nest a few levels).
MAX_TUPLE_DEPTH = 1000
# Heavier tuples are refused: no pickle of at most MAX_PICKLE reaches this
# without the memo sharing a tuple, each element being an opcode.
MAX_TUPLE_WEIGHT = 1 << 26
_SCALAR = (0, 1)
_REFUSED = {f"torch._utils.{name}" for name in (
    "_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_meta_tensor_no_storage", "_rebuild_nested_tensor",
    "_rebuild_wrapper_subclass", "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor")}


class ScanError(ValueError):
    """What is wrong with a pickle (the caller names the file)."""


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 60, 60, 40
_SHORT.maxtuple = _SHORT.maxlist = _SHORT.maxdict = _SHORT.maxset = _SHORT.maxfrozenset = 4


def short(value) -> str:
    """An unpickled ``value`` for an error message, in bounded work: a pickle's
    lists may nest deeply or share themselves, so that ``repr`` would not return.

    Example::

        >>> nested = []
        >>> for _ in range(100):
        ...     nested = [nested, nested]
        >>> short(nested)
        '[[[...], [...]], [[...], [...]]]'
    """
    try:
        return _SHORT.repr(value)
    except Exception:  # noqa: BLE001 - a value whose own repr fails
        return f"<a {type(value).__name__}>"


def _dcp_globals() -> dict:
    from torch.distributed.checkpoint import filesystem, metadata

    found = {f"torch.distributed.checkpoint.metadata.{name}": getattr(metadata, name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta")}
    found["torch.distributed.checkpoint.filesystem._StorageInfo"] = filesystem._StorageInfo
    # A checkpoint id saved as a path: a pure path, which touches no file.
    for name, pure in (("PosixPath", pathlib.PurePosixPath), ("WindowsPath", pathlib.PureWindowsPath),
                       ("PurePosixPath", pathlib.PurePosixPath), ("PureWindowsPath", pathlib.PureWindowsPath)):
        found[f"pathlib.{name}"] = pure
    return found


def allowed() -> dict:
    """``"module.name" -> object``: the globals a checkpoint's pickle may name (read
    only; computed again when ``torch.serialization.add_safe_globals`` changes them).

    Example::

        >>> allowed()["torch.Size"] is torch.Size, "torch._utils._rebuild_sparse_tensor" in allowed()
        (True, False)
    """
    while _ALLOWED[0] is not weights_only._marked_safe_globals_set:  # a new set whenever it changes
        marked = weights_only._marked_safe_globals_set
        # Computed again if it changed meanwhile: the first call imports
        # torch.distributed.checkpoint, which adds safe globals of its own.
        _ALLOWED[:] = [marked, _allowed()]
    return _ALLOWED[1]


_ALLOWED: list = [None, None]


def _allowed() -> dict:
    names = dict(weights_only._get_allowed_globals())
    names.update(weights_only._get_user_allowed_globals())
    for cls in torch._tensor_classes:  # legacy classes (torch.FloatTensor) build CPU tensors
        names.pop(f"{cls.__module__}.{cls.__name__}", None)
    for name in _REFUSED:
        names.pop(name, None)
    try:
        names.update(_dcp_globals())
    except ImportError:  # a torch without torch.distributed
        pass
    return names


# What each opcode does to the stack, and the width of its argument (or of its length).
(_PUSH, _TEXT, _BYTES, _TUPLE_N, _TUPLE, _EMPTY_TUPLE, _MARK, _POP_N, _POP_MARK, _SET_OF_MARK, _PERSID, _CALL,
 _GET, _PUT, _MEMOIZE, _NOTHING, _STOP, _GLOBAL, _STACK_GLOBAL) = range(19)
_OPS: dict = {}
for _kind, _width, _names in (
    (_PUSH, 0, "NONE NEWFALSE NEWTRUE EMPTY_LIST EMPTY_DICT EMPTY_SET"), (_PUSH, 1, "BININT1"),
    (_PUSH, 2, "BININT2"), (_PUSH, 4, "BININT"), (_PUSH, 8, "BINFLOAT"), (_TUPLE, 0, "TUPLE"),
    (_EMPTY_TUPLE, 0, "EMPTY_TUPLE"), (_MARK, 0, "MARK"), (_POP_MARK, 0, "APPENDS SETITEMS ADDITEMS"),
    (_SET_OF_MARK, 0, "FROZENSET"), (_PERSID, 0, "BINPERSID"), (_CALL, 0, "REDUCE NEWOBJ"), (_GET, 1, "BINGET"),
    (_GET, 4, "LONG_BINGET"), (_PUT, 1, "BINPUT"), (_PUT, 4, "LONG_BINPUT"), (_MEMOIZE, 0, "MEMOIZE"),
    (_NOTHING, 1, "PROTO"), (_NOTHING, 8, "FRAME"), (_STOP, 0, "STOP"), (_GLOBAL, 0, "GLOBAL"),
    (_STACK_GLOBAL, 0, "STACK_GLOBAL"), (_TEXT, 1, "SHORT_BINUNICODE"), (_TEXT, 4, "BINUNICODE"),
    (_TEXT, 8, "BINUNICODE8"), (_BYTES, 1, "SHORT_BINSTRING SHORT_BINBYTES LONG1"),
    (_BYTES, 4, "BINSTRING BINBYTES LONG4"), (_BYTES, 8, "BINBYTES8 BYTEARRAY8"),
):
    for _name in _names.split():
        _OPS[getattr(pickle, _name)[0]] = (_kind, _width, 0)
for _name, _n in (("TUPLE1", 1), ("TUPLE2", 2), ("TUPLE3", 3), ("NEWOBJ_EX", 3)):
    _OPS[getattr(pickle, _name)[0]] = (_TUPLE_N if _name != "NEWOBJ_EX" else _CALL, 0, _n)
for _name, _n in (("BUILD", 1), ("APPEND", 1), ("SETITEM", 2)):
    _OPS[getattr(pickle, _name)[0]] = (_POP_N, 0, _n)
_TABLE = [_OPS.get(_op) for _op in range(256)]


def _global_lines(data: bytes, i: int) -> tuple[str, int]:
    lines = []
    for _ in range(2):
        end = data.find(b"\n", i)
        if end < 0:
            raise ScanError("it ends inside a GLOBAL opcode")
        lines.append(data[i:end + 1])
        i = end + 1
    lines.reverse()
    try:
        module, name = weights_only._read_global_instruction(lines.pop)
    except UnicodeDecodeError:
        raise ScanError("it names a global that is not UTF-8") from None
    return f"{module}.{name}", i


def guard(data: bytes, names: dict | None = None) -> None:
    """Refuse (:class:`ScanError`) the pickle ``data`` unless it is safe to give an
    unpickler: it ends with STOP, uses the opcodes of plain values, names only
    globals of ``names`` (default :func:`allowed`), and its tuples are bounded."""
    if len(data) > MAX_PICKLE:
        raise ScanError(f"its pickle has {len(data)} bytes (load_checkpoint reads at most {MAX_PICKLE})")
    if names is not None:
        _walk(data, names)
        return
    names = allowed()
    if _PASSED[0] is not names:
        _PASSED[:] = [names, set()]
    if data in _PASSED[1]:
        return
    _walk(data, names)
    if len(data) <= _PASSED_BYTES and len(_PASSED[1]) < _PASSED_COUNT:
        _PASSED[1].add(bytes(data))


# The small pickles that passed against the allowed globals of the moment (the
# verdict is a function of the bytes and those globals): a distributed
# checkpoint's chunks repeat the same few (one per shape), hundreds of times.
_PASSED: list = [None, set()]
_PASSED_BYTES, _PASSED_COUNT = 1024, 1024


def _walk(data: bytes, names: dict) -> None:
    # The unpickler's stack: a tuple's (depth, weight), a string's value, else _SCALAR;
    # ``live`` turns false where the unpickler itself would fail (it stops there).
    stack: list = []
    marks: list = []
    memo: dict = {}
    live = True
    i, n = 0, len(data)
    ops, from_bytes = _TABLE, int.from_bytes
    while i < n:
        info = ops[data[i]]
        i += 1
        if info is None:
            raise ScanError(f"its pickle uses opcode {data[i - 1:i]!r}, which a checkpoint's pickle does not")
        kind, width, count = info
        if width:
            if i + width > n:
                break
            arg = from_bytes(data[i:i + width], "little")
            i += width
        if kind == _PUSH:
            if live:
                stack.append(_SCALAR)
            continue
        if kind == _MEMOIZE or kind == _PUT:
            if not stack:
                live = False
            elif live:
                memo[len(memo) if kind == _MEMOIZE else arg] = stack[-1]
            continue
        if kind == _GET:
            if live:
                stack.append(memo.get(arg, _SCALAR))
            continue
        if kind == _TEXT or kind == _BYTES:
            if kind == _BYTES and width == 4 and arg >= 1 << 31:
                raise ScanError("its pickle holds a string of negative length")
            if i + arg > n:
                break
            value = _SCALAR
            if kind == _TEXT:
                try:
                    value = data[i:i + arg].decode("utf-8", "surrogatepass")
                except UnicodeDecodeError:
                    live = False  # the unpickler stops there
            i += arg
            if live:
                stack.append(value)
            continue
        if kind == _STOP:
            return
        if kind == _GLOBAL:
            name, i = _global_lines(data, i)
            if name not in names:
                raise ScanError(f"its pickle uses {name}, which load_checkpoint does not allow")
            if live:
                stack.append(_SCALAR)
            continue
        if not live or kind == _NOTHING:
            continue
        if kind == _STACK_GLOBAL:
            if len(stack) < 2 or type(stack[-1]) is not str or type(stack[-2]) is not str:
                live = False
                continue
            name = f"{stack[-2]}.{stack[-1]}"
            if name not in names:
                raise ScanError(f"its pickle uses {name}, which load_checkpoint does not allow")
            stack[-2:] = [_SCALAR]
        elif kind == _TUPLE_N or kind == _TUPLE or kind == _EMPTY_TUPLE:
            if kind == _TUPLE_N:
                if len(stack) < count:
                    live = False
                    continue
                items = stack[len(stack) - count:]
                del stack[len(stack) - count:]
            elif kind == _TUPLE:
                if not marks:
                    live = False
                    continue
                items, stack = stack, marks.pop()
            else:
                items = ()
            depth, weight = 1, 1
            for item in items:
                if type(item) is tuple:
                    depth = max(depth, item[0] + 1)
                    weight += item[1]
                else:
                    weight += 1
            if depth > MAX_TUPLE_DEPTH:
                raise ScanError(
                    f"it nests tuples more than {MAX_TUPLE_DEPTH} deep (the unpickler would crash the process "
                    "hashing them)"
                )
            if weight > MAX_TUPLE_WEIGHT:
                raise ScanError(
                    f"it builds a tuple of more than {MAX_TUPLE_WEIGHT} elements counted through its nesting, "
                    "sharing tuples through its memo (the unpickler would take that long hashing it)"
                )
            stack.append((depth, weight))
        elif kind == _MARK:
            marks.append(stack)
            stack = []
        elif kind == _POP_N or kind == _PERSID or kind == _CALL:
            # A call may return what it was given: its result weighs its arguments.
            need = 2 if kind == _CALL and not count else count or 1
            if len(stack) < need:
                live = False
                continue
            top = stack[-1] if kind != _CALL or not count else stack[-2]
            del stack[len(stack) - need:]
            if kind == _PERSID:
                stack.append(_SCALAR)
            elif kind == _CALL:
                stack.append(top if type(top) is tuple else _SCALAR)
        elif kind == _POP_MARK or kind == _SET_OF_MARK:
            if not marks:
                live = False
                continue
            stack = marks.pop()
            if kind == _SET_OF_MARK:
                stack.append(_SCALAR)
    raise ScanError("its pickle ends before its STOP opcode")


class RestrictedUnpickler(pickle.Unpickler):
    """Python's unpickler, which finds only the globals :func:`allowed` gives and
    loads no persistent id: for a pickle :func:`guard` passed."""

    def __init__(self, file, names: dict):
        super().__init__(file)
        self._names = names

    def find_class(self, module, name):
        found = self._names.get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which load_checkpoint does not allow")
        return found

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id")
