"""Each rule of the safetensors format, against the safetensors library.

For every header below, ``safetensors.torch.load_file`` is the reference: a
file it refuses, ``load_checkpoint`` refuses with ``CheckpointError`` at the
call; a file it reads, ``load_checkpoint`` reads with the same tensors
(dtype, shape and bytes).  The cases follow the library's own checks
(``read_metadata`` and ``Metadata::validate`` of its Rust crate, with
``serde_json`` reading the header) rule by rule.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from deferinit import CheckpointError
from deferinit.materialize.checkpoint.sources import open_source

D8 = bytes(range(8))
T = '"dtype":"U8","shape":[8],"data_offsets":[0,8]'


def blob(header, data=D8, n=None) -> bytes:
    text = header.encode() if isinstance(header, str) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if n is None else n) + text + data


CASES = {
    # the length prefix
    "empty file": b"",
    "7 bytes": b"\x02\0\0\0\0\0\0",
    "length past the end": blob("{" + '"a":{' + T + "}}", n=1000),
    "length over 100MB": blob("{" + '"a":{' + T + "}}", n=100_000_001),
    "length zero": blob("", b""),
    # the JSON
    "valid": blob("{" + '"a":{' + T + "}}"),
    "empty header, no data": blob("{}", b""),
    "empty header, data": blob("{}"),
    "not UTF-8": blob('{"a\xff":{' + T + "}}"),
    "UTF-16": struct.pack("<Q", 102) + ('{"a":{' + T + "}}").encode("utf-16")[:102] + D8,
    "byte order mark": blob("\ufeff{" + '"a":{' + T + "}}"),
    "a list": blob("[]", b""),
    "leading and trailing spaces": blob('  {"a":{' + T + "}}   "),
    "tabs and newlines": blob('\t{"a":{' + T + "}}\n\r"),
    "form feed": blob('\x0c{"a":{' + T + "}}"),
    "NUL padding": blob('{"a":{' + T + "}}\0\0"),
    "NaN": blob('{"a":{' + T + ',"x":NaN}}'),
    "Infinity": blob('{"a":{' + T + ',"x":Infinity}}'),
    "1e400": blob('{"a":{' + T + ',"x":1e400}}'),
    "25-digit integer": blob('{"a":{' + T + ',"x":' + "9" * 25 + "}}"),
    "400-digit integer": blob('{"a":{' + T + ',"x":' + "9" * 400 + "}}"),
    "lone surrogate": blob('{"a":{' + T + ',"x":"\\ud800"}}'),
    "surrogate pair": blob('{"a\\ud83d\\ude00":{' + T + "}}"),
    "control character": blob('{"a\x01":{' + T + "}}"),
    "escaped key": blob('{"\\u00e9":{' + T + "}}"),
    "126 levels": blob('{"a":{' + T + ',"x":' + "[" * 125 + "]" * 125 + "}}"),
    "127 levels": blob('{"a":{' + T + ',"x":' + "[" * 126 + "]" * 126 + "}}"),
    "3000 levels": blob('{"a":{' + T + ',"x":' + "[" * 3000 + "]" * 3000 + "}}"),
    # __metadata__
    "metadata of strings": blob('{"__metadata__":{"k":"v"},"a":{' + T + "}}"),
    "metadata null": blob('{"__metadata__":null,"a":{' + T + "}}"),
    "metadata number": blob('{"__metadata__":{"k":1},"a":{' + T + "}}"),
    "metadata list": blob('{"__metadata__":[],"a":{' + T + "}}"),
    "metadata twice": blob('{"__metadata__":{},"__metadata__":{},"a":{' + T + "}}"),
    "metadata key twice": blob('{"__metadata__":{"k":"a","k":"b"},"a":{' + T + "}}"),
    "escaped metadata key": blob('{"\\u005f_metadata__":{"x":"y"},"a":{' + T + "}}"),
    # a tensor's description
    "extra field": blob('{"a":{' + T + ',"x":[1,{}]}}'),
    "field twice": blob('{"a":{"dtype":"F32",' + T + "}}"),
    "extra field twice": blob('{"a":{' + T + ',"x":1,"x":2}}'),
    "no data_offsets": blob('{"a":{"dtype":"U8","shape":[8]}}'),
    "a list of three": blob('{"a":["U8",[8],[0,8]]}'),
    "a list of two": blob('{"a":["U8",[8]]}'),
    "a list of four": blob('{"a":["U8",[8],[0,8],1]}'),
    "a string": blob('{"a":"x"}'),
    "null": blob('{"a":null}'),
    "key twice, last wins": blob('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"a":{' + T + "}}"),
    "empty key": blob('{"":{' + T + "}}"),
    # dtypes
    "unknown dtype": blob('{"a":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}}'),
    "lower-case dtype": blob('{"a":{"dtype":"u8","shape":[8],"data_offsets":[0,8]}}'),
    "dtype as a map": blob('{"a":{"dtype":{"U8":null},"shape":[8],"data_offsets":[0,8]}}'),
    "dtype map of two": blob('{"a":{"dtype":{"U8":null,"I8":null},"shape":[8],"data_offsets":[0,8]}}'),
    "dtype map with a value": blob('{"a":{"dtype":{"U8":[]},"shape":[8],"data_offsets":[0,8]}}'),
    "dtype number": blob('{"a":{"dtype":3,"shape":[8],"data_offsets":[0,8]}}'),
    "F8_E8M0": blob('{"a":{"dtype":"F8_E8M0","shape":[8],"data_offsets":[0,8]}}'),
    "F8_E4M3FNUZ": blob('{"a":{"dtype":"F8_E4M3FNUZ","shape":[8],"data_offsets":[0,8]}}'),
    "C64": blob('{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}'),
    "U64": blob('{"a":{"dtype":"U64","shape":[],"data_offsets":[0,8]}}'),
    "BOOL bytes": blob('{"a":{"dtype":"BOOL","shape":[8],"data_offsets":[0,8]}}'),
    "F4, even last dimension": blob('{"a":{"dtype":"F4","shape":[4,4],"data_offsets":[0,8]}}'),
    "F4, odd last dimension": blob('{"a":{"dtype":"F4","shape":[2,3],"data_offsets":[0,3]}}', D8[:3]),
    "F4 scalar": blob('{"a":{"dtype":"F4","shape":[],"data_offsets":[0,0]}}', b""),
    "F6": blob('{"a":{"dtype":"F6_E2M3","shape":[4],"data_offsets":[0,3]}}', D8[:3]),
    # shapes
    "scalar": blob('{"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]}}', D8[:4]),
    "negative dimension": blob('{"a":{"dtype":"U8","shape":[-8],"data_offsets":[0,8]}}'),
    "-0 dimension": blob('{"z":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]},"a":{' + T + "}}"),
    "float dimension": blob('{"a":{"dtype":"U8","shape":[8.0],"data_offsets":[0,8]}}'),
    "8e0 dimension": blob('{"a":{"dtype":"U8","shape":[8e0],"data_offsets":[0,8]}}'),
    "string dimension": blob('{"a":{"dtype":"U8","shape":["8"],"data_offsets":[0,8]}}'),
    "null shape": blob('{"a":{"dtype":"U8","shape":null,"data_offsets":[0,8]}}'),
    "shape map": blob('{"a":{"dtype":"U8","shape":{"a":8},"data_offsets":[0,8]}}'),
    "reshaped": blob('{"a":{"dtype":"U8","shape":[2,2,2],"data_offsets":[0,8]}}'),
    "zero size, huge dims": blob('{"z":{"dtype":"U8","shape":[0,4611686018427387904],"data_offsets":[0,0]},"a":{' + T + "}}"),
    "overflow before the zero": blob('{"z":{"dtype":"U8","shape":[9223372036854775808,9223372036854775808,0],"data_offsets":[0,0]},"a":{' + T + "}}"),
    "dimension past int64": blob('{"z":{"dtype":"U8","shape":[0,9223372036854775808],"data_offsets":[0,0]},"a":{' + T + "}}"),
    "overflowing size": blob('{"a":{"dtype":"U8","shape":[1099511627776,1099511627776],"data_offsets":[0,8]}}'),
    # offsets
    "string offsets": blob('{"a":{"dtype":"U8","shape":[8],"data_offsets":["0","8"]}}'),
    "float offsets": blob('{"a":{"dtype":"U8","shape":[8],"data_offsets":[0.0,8.0]}}'),
    "boolean offsets": blob('{"a":{"dtype":"U8","shape":[1],"data_offsets":[false,true]}}', D8[:1]),
    "negative offset": blob('{"a":{"dtype":"U8","shape":[8],"data_offsets":[-8,0]}}'),
    "-0 offset": blob('{"a":{"dtype":"U8","shape":[8],"data_offsets":[-0,8]}}'),
    "three offsets": blob('{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8,8]}}'),
    "one offset": blob('{"a":{"dtype":"U8","shape":[8],"data_offsets":[8]}}'),
    "offsets map": blob('{"a":{"dtype":"U8","shape":[8],"data_offsets":{"0":0,"1":8}}}'),
    "offset 2^64": blob('{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,18446744073709551616]}}'),
    "end before begin": blob('{"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]},"b":{' + T + "}}"),
    "in order": blob('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}}'),
    "out of order in the header": blob('{"b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]},"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}'),
    "gap": blob('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}}'),
    "overlap": blob('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}', D8[:6]),
    "same bytes twice": blob('{"a":{' + T + '},"b":{' + T + "}}"),
    "two empty at the end": blob('{"z":{"dtype":"U8","shape":[0],"data_offsets":[8,8]},"y":{"dtype":"U8","shape":[0],"data_offsets":[8,8]},"a":{' + T + "}}"),
    "empty in the middle": blob('{"z":{"dtype":"U8","shape":[0],"data_offsets":[4,4]},"a":{' + T + "}}"),
    "size not the shape's": blob('{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}}'),
    # the data section
    "bytes after the last tensor": blob("{" + '"a":{' + T + "}}", D8 + b"x"),
    "truncated data": blob("{" + '"a":{' + T + "}}", D8[:7]),
}


def _ours(path):
    entries, _ = open_source(path)
    out = {}
    for key, entry in entries.items():
        t = torch.empty(entry.shape, dtype=entry.dtype)
        entry.read_parts(t)
        out[key] = t
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_header_rule_as_the_safetensors_library(tmp_path, name):
    path = tmp_path / "case.safetensors"
    path.write_bytes(CASES[name])
    try:
        reference = load_file(path)
    except Exception:  # noqa: BLE001 - any refusal of the reference
        reference = None
    if reference is None:
        with pytest.raises(CheckpointError, match="case.safetensors is not a valid safetensors file"):
            _ours(path)
        return
    ours = _ours(path)
    assert sorted(ours) == sorted(reference)
    for key, t in reference.items():
        assert ours[key].dtype == t.dtype and ours[key].shape == t.shape, key
        written = torch.empty_like(t).copy_(t)  # what load_state_dict's copy_ writes (a bool: 0 or 1)
        assert torch.equal(ours[key].reshape(-1).view(torch.uint8), written.reshape(-1).view(torch.uint8)), key


def test_both_outcomes_are_covered():
    accepted = sum(1 for b in CASES.values() if _reference_accepts(b))
    assert 15 < accepted < len(CASES) - 15


def _reference_accepts(data: bytes) -> bool:
    from safetensors.torch import load

    try:
        load(data)
        return True
    except Exception:  # noqa: BLE001
        return False
