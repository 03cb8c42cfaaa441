"""A safetensors header, checked by every rule of the format.

The reference is the safetensors library itself (``SafeTensors::read_metadata``
and ``Metadata::validate`` in its Rust crate, whose JSON is read by
``serde_json``): a file it refuses is refused here, and a file it accepts
gives the same tensors.  The rules:

* 8 bytes: ``n``, the header's length, little-endian; at most 100,000,000,
  and the file holds the 8 + ``n`` bytes;
* ``n`` bytes of UTF-8 JSON (serde's JSON: no ``NaN``/``Infinity``, numbers
  in range, no lone surrogates, at most 127 levels of nesting), an object;
* its ``__metadata__`` (once at most) is null or an object of strings; every
  other key is a tensor: ``dtype`` (a name of the format), ``shape`` (a list
  of non-negative integers) and ``data_offsets`` (two non-negative
  integers, not floats, strings or booleans), each once, in an object (other
  fields ignored) or a list of those three;
* sorted by offsets, the tensors tile the data section: each begins where
  the previous ended, spans exactly its elements' bytes, and the last ends
  at the end of the file (nothing before, between or after them).
"""

from __future__ import annotations

import json
import math
import re
import struct

import numpy
import torch

# Safetensors' own limit on the header's length.
MAX_HEADER = 100_000_000
_U64 = 2**64 - 1
_I64 = 2**63 - 1
# serde_json refuses JSON nested this deep (the outer object counts).
_MAX_DEPTH = 128

# Bits per element of every dtype the format defines (Dtype::bitsize).
FORMAT_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
# The torch dtype safetensors.torch gives each (sub-byte ones have none).
TORCH_DTYPES = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
        "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
        "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64",
        "F4": "float4_e2m1fn_x2",  # two elements a byte: the last dimension halves
    }.items()
    if hasattr(torch, attr)
}
_FIELDS = ("dtype", "shape", "data_offsets")


class HeaderError(ValueError):
    """What is wrong with a header (the caller names the file)."""


class _Object(dict):
    """A JSON object that remembers the keys it had more than once."""

    def __init__(self, pairs):
        super().__init__(pairs)
        self.repeated = set()
        if len(self) < len(pairs):
            seen = set()
            for key, _ in pairs:
                (self.repeated if key in seen else seen).add(key)


def _int(text: str):
    # serde reads "-0" and integers outside 64 bits as floats, and refuses
    # those that overflow a double.
    if text == "-0":
        return -0.0
    value = int(text)
    if not -(2**63) <= value <= _U64 and math.isinf(float(text)):
        raise HeaderError(f"number out of range: {text[:40]}")
    return value


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise HeaderError(f"number out of range: {text[:40]}")
    return value


def _constant(text: str):
    raise HeaderError(f"{text} is not JSON")


def _check_tree(root) -> None:
    """Nesting depth and strings (lone surrogates) as serde checks them."""
    stack = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth >= _MAX_DEPTH:
                raise HeaderError(f"JSON nested more than {_MAX_DEPTH - 1} levels deep")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    key.encode("utf-8")
                stack.append((item, depth + 1))
        elif isinstance(value, str):
            value.encode("utf-8")


# JSON strings (to look at what lies outside them), escaped surrogates, "-0".
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_MINUS_ZERO = re.compile(rb"-0(?![0-9])")
_ZEROS = bytes.maketrans(b"123456789", b"000000000")


def _needs_care(raw: bytes, bare: bytes) -> bool:
    """Whether the JSON ``raw`` (``bare``: its strings emptied) may hold what
    Python's json reads and serde refuses or reads otherwise: an escaped
    surrogate, NaN/Infinity, a number with an exponent or of 20 digits or more
    (out of range?), "-0" (a float to serde)."""
    if b"\\u" in raw and _SURROGATE.search(raw):
        return True
    if b"NaN" in bare or b"Infinity" in bare:
        return True
    letters = bare.replace(b"true", b"").replace(b"false", b"")
    if b"e" in letters or b"E" in letters or b"0" * 20 in bare.translate(_ZEROS):
        return True
    return b"-0" in bare and _MINUS_ZERO.search(bare) is not None


def _pairs(pairs):
    d = dict(pairs)
    return d if len(d) == len(pairs) else _Object(pairs)


def _depth(bare: bytes) -> int:
    """Deepest nesting of the JSON text ``bare`` (its strings removed)."""
    chars = numpy.frombuffer(bare, dtype=numpy.uint8)
    steps = numpy.isin(chars, (91, 123)).astype(numpy.int64) - numpy.isin(chars, (93, 125))
    return int(numpy.cumsum(steps).max()) if len(steps) else 0


def parse_json(raw: bytes):
    """The header's JSON, read as safetensors reads it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    bare = _STRINGS.sub(b'""', raw)
    try:
        if _needs_care(raw, bare):
            header = json.loads(text, object_pairs_hook=_Object, parse_int=_int, parse_float=_float, parse_constant=_constant)
            _check_tree(header)
        else:
            header = json.loads(text, object_pairs_hook=_pairs)
    except HeaderError:
        raise
    except UnicodeEncodeError:
        raise HeaderError("a string holds a lone surrogate (\\ud800-\\udfff)") from None
    except RecursionError:
        raise HeaderError(f"JSON nested more than {_MAX_DEPTH - 1} levels deep") from None
    except ValueError as e:
        raise HeaderError(f"invalid JSON: {e}") from None
    if _depth(bare) >= _MAX_DEPTH:
        raise HeaderError(f"JSON nested more than {_MAX_DEPTH - 1} levels deep")
    return header


def _usize(value, what: str) -> int:
    if type(value) is not int or not 0 <= value <= _U64:
        raise HeaderError(f"{what} is {json.dumps(value)[:40]}, not a non-negative integer")
    return value


def _dtype(value, key: str) -> str:
    if isinstance(value, dict):  # serde also reads an enum as {"NAME": null}
        if len(value) != 1 or getattr(value, 'repeated', ()) or next(iter(value.values())) is not None:
            raise HeaderError(f"{key!r} has dtype {json.dumps(value)[:60]}")
        value = next(iter(value))
    if not isinstance(value, str) or value not in FORMAT_BITS:
        raise HeaderError(f"{key!r} has dtype {json.dumps(value)[:60]}, which is not a safetensors dtype")
    return value


def _tensor(key: str, info) -> tuple:
    if isinstance(info, list):  # serde reads a struct from a sequence too
        if len(info) != 3:
            raise HeaderError(f"{key!r} is a list of {len(info)} items, not [dtype, shape, data_offsets]")
        values = info
    elif isinstance(info, dict):
        for field in _FIELDS:
            if field not in info:
                raise HeaderError(f"{key!r} has no {field!r}")
            if field in getattr(info, 'repeated', ()):
                raise HeaderError(f"{key!r} has {field!r} twice")
        values = [info[f] for f in _FIELDS]
    else:
        raise HeaderError(f"{key!r} is {json.dumps(info)[:40]}, not a tensor's description")
    name = _dtype(values[0], key)
    shape, offsets = values[1], values[2]
    if not isinstance(shape, list):
        raise HeaderError(f"{key!r} has shape {json.dumps(shape)[:40]}, not a list")
    shape = tuple(_usize(n, f"a dimension of {key!r}") for n in shape)
    if not isinstance(offsets, list) or len(offsets) != 2:
        raise HeaderError(f"{key!r} has data_offsets {json.dumps(offsets)[:40]}, not [begin, end]")
    begin, end = (_usize(n, f"an offset of {key!r}") for n in offsets)
    return name, shape, begin, end


def _nbytes(key: str, name: str, shape: tuple) -> int:
    numel = 1
    for n in shape:  # in order, as the format's checked multiplication overflows
        numel *= n
        if numel > _U64:
            raise HeaderError(f"{key!r}: the size of shape {list(shape)} overflows")
    bits = numel * FORMAT_BITS[name]
    if bits > _U64:
        raise HeaderError(f"{key!r}: the size of shape {list(shape)} {name} overflows")
    if bits % 8:
        raise HeaderError(f"{key!r}: {list(shape)} {name} is not a whole number of bytes")
    return bits // 8


def read_header(f, size: int) -> tuple[int, list]:
    """``(data start, [(key, torch dtype, shape, byte position)])`` of the
    safetensors file open as ``f`` (``size`` bytes); raises :class:`HeaderError`.

    Example::

        >>> import io, json, struct
        >>> head = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
        >>> blob = struct.pack("<Q", len(head)) + head + bytes(8)
        >>> read_header(io.BytesIO(blob), len(blob))[1]
        [('w', torch.float32, (2,), 69)]
    """
    if size < 8:
        raise HeaderError(f"{size} bytes, too short for the header's length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER:
        raise HeaderError(f"its header would be {n} bytes (the format allows {MAX_HEADER})")
    if 8 + n > size:
        raise HeaderError(f"its header would be {n} bytes, the file has {size - 8} after the length")
    header = parse_json(f.read(n))
    if not isinstance(header, dict):
        raise HeaderError(f"the header is a JSON {type(header).__name__}, not an object")
    if "__metadata__" in getattr(header, "repeated", ()):
        raise HeaderError("'__metadata__' is given twice")
    meta = header.get("__metadata__")
    if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
        raise HeaderError(f"'__metadata__' is {json.dumps(meta)[:60]}, not an object of strings")
    tensors = [(key, *_tensor(key, info)) for key, info in header.items() if key != "__metadata__"]
    end = 0
    for key, name, shape, begin, stop in sorted(tensors, key=lambda t: (t[3], t[4])):
        if begin != end or stop < begin:
            where = "overlaps the tensor before it" if begin < end else "leaves a gap before it" if begin > end else "ends before it begins"
            raise HeaderError(f"{key!r} spans bytes {begin} to {stop} of the data, which {where} (at {end})")
        end = stop
        nbytes = _nbytes(key, name, shape)
        if stop - begin != nbytes:
            raise HeaderError(f"{key!r} spans {stop - begin} bytes, {list(shape)} {name} takes {nbytes}")
    if 8 + n + end > size:
        raise HeaderError(f"it is truncated: its tensors end at byte {8 + n + end}, the file has {size}")
    if 8 + n + end < size:
        raise HeaderError(f"it has {size - 8 - n - end} bytes after its last tensor (the format allows none)")
    entries = []
    for key, name, shape, begin, _ in tensors:
        if name not in TORCH_DTYPES:
            raise HeaderError(f"{key!r} has dtype {name}, which PyTorch cannot hold")
        if any(d > _I64 for d in shape):
            raise HeaderError(f"{key!r} has shape {list(shape)}, too large for PyTorch")
        if name == "F4":
            if not shape or shape[-1] % 2:
                raise HeaderError(f"{key!r} is {list(shape)} F4: PyTorch packs F4 in pairs along an even last dimension")
            shape = (*shape[:-1], shape[-1] // 2)
        entries.append((key, TORCH_DTYPES[name], shape, 8 + n + begin))
    return 8 + n, entries
