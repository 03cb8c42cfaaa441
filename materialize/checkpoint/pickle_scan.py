"""A pickle's opcodes, walked before PyTorch's weights-only unpickler runs them.

The walk reads the opcodes ``torch._weights_only_unpickler`` reads, as its
own scanner (``get_globals_in_pkl``) does, and returns the globals the
pickle names.  It also follows what the unpickler's stack would hold, as
far as the nesting of tuples goes: a tuple nested a few hundred thousand
deep, a megabyte of ``TUPLE1`` opcodes, crashes the process (SIGSEGV) as
soon as it is hashed, by a dict key or a storage key, since CPython hashes
tuples recursively with no depth check.  A tuple holding another twice,
sixty times over (``t = (t, t)`` through the pickle's memo, a few hundred
bytes), takes 2**60 steps to hash: the unpickler never returns.  Such
pickles are refused before they are unpickled: each tuple's depth and
weight (its elements, counted through every nesting as hashing visits
them) are followed, and bounded.
"""

from __future__ import annotations

import pickle
import struct

from torch import _weights_only_unpickler as weights_only

# Deeper tuples are refused (real checkpoints nest a few levels).
MAX_TUPLE_DEPTH = 1000
# Heavier tuples are refused: no pickle of at most 64 MiB (torch_zip.MAX_PICKLE)
# reaches this without the memo sharing a tuple, each element being an opcode.
MAX_TUPLE_WEIGHT = 1 << 26
_SCALAR = (0, 1)

# What each opcode the unpickler reads does to the stack, and its argument's width.
(_PUSH, _TUPLE_N, _TUPLE, _EMPTY_TUPLE, _MARK, _POP_N, _POP_MARK, _PERSID, _CALL, _GET, _PUT, _NOTHING,
 _STOP, _GLOBAL, _STRING4, _STRING1) = range(16)
_OPS = {}
for _kind, _width, _names in (
    (_PUSH, 0, "NONE NEWFALSE NEWTRUE EMPTY_LIST EMPTY_DICT EMPTY_SET"), (_PUSH, 1, "BININT1"),
    (_PUSH, 2, "BININT2"), (_PUSH, 4, "BININT"), (_PUSH, 8, "BINFLOAT"), (_TUPLE, 0, "TUPLE"),
    (_EMPTY_TUPLE, 0, "EMPTY_TUPLE"), (_MARK, 0, "MARK"), (_POP_MARK, 0, "APPENDS SETITEMS"),
    (_PERSID, 0, "BINPERSID"), (_CALL, 0, "REDUCE NEWOBJ"), (_GET, 1, "BINGET"), (_GET, 4, "LONG_BINGET"),
    (_PUT, 1, "BINPUT"), (_PUT, 4, "LONG_BINPUT"), (_NOTHING, 1, "PROTO"), (_STOP, 0, "STOP"),
    (_GLOBAL, 0, "GLOBAL"), (_STRING4, 0, "BINUNICODE"), (_STRING1, 0, "SHORT_BINSTRING LONG1"),
):
    for _name in _names.split():
        _OPS[getattr(pickle, _name)[0]] = (_kind, _width, 0)
for _name, _n in (("TUPLE1", 1), ("TUPLE2", 2), ("TUPLE3", 3)):
    _OPS[getattr(pickle, _name)[0]] = (_TUPLE_N, 0, _n)
for _name, _n in (("BUILD", 1), ("APPEND", 1), ("SETITEM", 2)):
    _OPS[getattr(pickle, _name)[0]] = (_POP_N, 0, _n)


class ScanError(ValueError):
    """What is wrong with a pickle (the caller names the file)."""


class NeedMore(Exception):
    """The pickle goes on past the bytes given (the caller reads more, or it is cut short)."""


def _global(data: bytes, i: int, n: int) -> tuple[str, int]:
    lines = []
    for _ in range(2):
        end = data.find(b"\n", i, n)
        if end < 0:
            raise NeedMore
        lines.append(data[i:end + 1])
        i = end + 1
    lines.reverse()
    try:
        module, name = weights_only._read_global_instruction(lines.pop)
    except UnicodeDecodeError:
        raise ScanError("its pickle names a global that is not UTF-8") from None
    return f"{module}.{name}", i


def scan(data: bytes, start: int = 0) -> tuple[set, int]:
    """``(the globals named, where the pickle ends)`` of the pickle at ``start``
    in ``data``; raises :class:`ScanError` for a pickle the unpickler must not
    run, :class:`NeedMore` where ``data`` ends before the pickle's STOP.

    Example::

        >>> data = pickle.dumps({"w": (1, 2)}, protocol=2)
        >>> scan(data) == (set(), len(data))
        True
        >>> scan(b"\\x80\\x02}" + b")" + b"\\x85" * 5000 + b"Ns.")
        Traceback (most recent call last):
        ...
        deferinit.materialize.checkpoint.pickle_scan.ScanError: its pickle nests tuples more than 1000 deep ...
    """
    names: set = set()
    # The unpickler's stack, each value's (tuple depth, weight) in place of the value;
    # ``live`` turns false where the unpickler itself would fail (it stops there).
    stack: list = []
    marks: list = []
    memo: dict = {}
    live = True
    i, n = start, len(data)
    ops = _OPS
    while True:
        if i >= n:
            raise NeedMore
        op = data[i]
        i += 1
        info = ops.get(op)
        if info is None:
            raise ScanError(f"its pickle uses opcode {bytes([op])!r}, which torch.load(weights_only=True) refuses")
        kind, width, count = info
        if i + width > n:
            raise NeedMore
        arg = data[i:i + width]
        i += width
        if kind == _STOP:
            return names, i
        if kind == _GLOBAL:
            name, i = _global(data, i, n)
            names.add(name)
        elif kind == _STRING4 or kind == _STRING1:
            if i + (4 if kind == _STRING4 else 1) > n:
                raise NeedMore
            length = struct.unpack_from("<I", data, i)[0] if kind == _STRING4 else data[i]
            i += (4 if kind == _STRING4 else 1) + length
            if i > n:
                raise NeedMore
        if not live:
            continue
        if kind <= _PUSH or kind == _GLOBAL or kind >= _STRING4:
            stack.append(_SCALAR)
        elif kind == _TUPLE_N or kind == _TUPLE or kind == _EMPTY_TUPLE:
            if kind == _TUPLE_N:
                if len(stack) < count:
                    live = False
                    continue
                items = stack[-count:]
                del stack[-count:]
            elif kind == _TUPLE:
                if not marks:
                    live = False
                    continue
                items = stack
                stack = marks.pop()
            else:
                items = ()
            depth = max((d for d, _ in items), default=0) + 1
            weight = sum(w for _, w in items) + 1
            if depth > MAX_TUPLE_DEPTH:
                raise ScanError(
                    f"its pickle nests tuples more than {MAX_TUPLE_DEPTH} deep (PyTorch's unpickler would "
                    "crash the process hashing them)"
                )
            if weight > MAX_TUPLE_WEIGHT:
                raise ScanError(
                    f"its pickle builds a tuple of more than {MAX_TUPLE_WEIGHT} elements counted through its "
                    "nesting, sharing tuples through its memo (PyTorch's unpickler would take that long "
                    "hashing it)"
                )
            stack.append((depth, weight))
        elif kind == _MARK:
            marks.append(stack)
            stack = []
        elif kind == _POP_N or kind == _PERSID or kind == _CALL:
            # A call may return what it was given: its result counts its arguments.
            need = 2 if kind == _CALL else count or 1
            if len(stack) < need:
                live = False
                continue
            top = stack[-1]
            del stack[len(stack) - need:]
            if kind == _PERSID:
                stack.append(_SCALAR)
            elif kind == _CALL:
                stack.append(top)
        elif kind == _POP_MARK:
            if not marks:
                live = False
                continue
            stack = marks.pop()
        elif kind == _GET:
            stack.append(memo.get(int.from_bytes(arg, "little"), _SCALAR))
        elif kind == _PUT:
            if not stack:
                live = False
                continue
            memo[int.from_bytes(arg, "little")] = stack[-1]
