"""Seeds and mutations for the checkpoint fuzzer (tests/materialize/test_checkpoint_fuzz.py).

Seeds are valid checkpoints of :class:`checkpoint_fuzz_worker.Holder`'s keys:
a safetensors file; ``torch.save`` archives (torch's own layout with tensors
that are strided views sharing storages, the same re-zipped by ``zipfile``
stored and deflated, and a big-endian one); folders with an index over two
safetensors shards and over two ``torch.save`` shards.

Distributed checkpoints (``dcp.save`` by one process, and by two FSDP2
ranks) are mutated through their metadata as PyTorch's objects (offsets,
lengths, file names leaving the folder or missing, dtypes, shapes, chunks,
keys, index entries, hostile nesting spliced into the pickle), their
chunks' archives (as ``torch.save`` archives are), their bytes, and
symbolic links leaving the folder (``.metadata`` included).

A mutant is a seed after one to three mutations drawn from a seeded
``random.Random``; each mutation returns a description, so a failure names
exactly what was done.  Mutations know the formats: safetensors headers
(offsets, shapes, dtypes, fields, keys, ``__metadata__``, the length prefix,
JSON number forms, padding, nesting), zip archives (records shortened,
swapped, renamed, removed, added, re-zipped; central-directory, local-header
and end-record fields; the pickle's integers, keys, storage types and bytes
with its CRC fixed; the state dict shared, cyclic, nested too deep or keyed
by tuples nested too deep; ``byteorder``; ``version``), index files (names leaving
the folder, missing files, wrong types, symbolic links); and plain bytes
(truncation, bit flips, insertions, deletions, garbage appended).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import pickletools
import random
import struct
import zipfile

import torch

from checkpoint_zip import crc_patch, rezip, zip_fields

SAFETENSORS_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "U16", "U32", "U64",
                      "C64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F8_E4M3FNUZ", "X", "f32", "F33"]
STORAGE_TYPES = [b"FloatStorage", b"DoubleStorage", b"HalfStorage", b"IntStorage", b"LongStorage", b"ByteStorage",
                 b"BoolStorage", b"ComplexFloatStorage", b"BFloat16Storage", b"ShortStorage", b"QInt8Storage", b"NotAStorage"]


# -- plain bytes --------------------------------------------------------------


def bytes_mutation(blob: bytes, rng: random.Random, region=None) -> tuple[bytes, str]:
    lo, hi = region or (0, len(blob))
    hi = max(hi, lo + 1)
    at = rng.randrange(lo, min(hi, len(blob))) if len(blob) > lo else 0
    how = rng.choice(["truncate", "flip", "flip", "overwrite", "insert", "delete", "append"])
    if how == "truncate":
        return blob[:at], f"truncated to {at} bytes"
    if how == "flip":
        out = bytearray(blob)
        bits = [(rng.randrange(lo, min(hi, len(blob))), rng.randrange(8)) for _ in range(rng.choice([1, 1, 2, 4]))] if len(blob) > lo else []
        for i, b in bits:
            out[i] ^= 1 << b
        return bytes(out), f"flipped bits {bits}"
    if how == "overwrite":
        n = rng.choice([1, 2, 4, 8])
        junk = bytes(rng.randrange(256) for _ in range(n))
        return blob[:at] + junk + blob[at + n:], f"overwrote {n} bytes at {at} with {junk.hex()}"
    if how == "insert":
        junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 4, 8])))
        return blob[:at] + junk + blob[at:], f"inserted {junk.hex()} at {at}"
    if how == "delete":
        n = rng.choice([1, 4, 8])
        return blob[:at] + blob[at + n:], f"deleted {n} bytes at {at}"
    junk = bytes(rng.randrange(256) for _ in range(rng.choice([1, 8, 100])))
    return blob + junk, f"appended {len(junk)} bytes"


# -- safetensors ---------------------------------------------------------------


def _split(blob: bytes):
    n = struct.unpack("<Q", blob[:8])[0]
    return n, blob[8:8 + n], blob[8 + n:]


def _join(text: bytes, data: bytes, n=None) -> bytes:
    return struct.pack("<Q", len(text) if n is None else n) + text + data


def _number_forms(v: int, rng: random.Random):
    return rng.choice([v + 1, v - 1, -v, 0, -1, v * 2, 2**63, 2**64, 2**64 + v, float(v), str(v), True, False, None,
                       [v], -(2**63)])


def safetensors_mutation(blob: bytes, rng: random.Random) -> tuple[bytes, str]:
    try:
        n, text, data = _split(blob)
        header = json.loads(text)
        assert isinstance(header, dict)
    except Exception:  # noqa: BLE001 - already broken: mutate its bytes
        return bytes_mutation(blob, rng)
    keys = [k for k in header if k != "__metadata__" and isinstance(header[k], dict)]
    how = rng.choice(["offset", "offset", "offsets_swap", "shape", "shape", "dtype", "dtype", "field", "form", "key",
                      "metadata", "length", "number_text", "padding", "nesting", "data", "header_bytes"])
    if not keys and how in ("offset", "offsets_swap", "shape", "dtype", "field", "form", "key", "nesting"):
        how = "header_bytes"
    key = rng.choice(keys) if keys else None
    info = header.get(key)
    if how == "offset":
        i = rng.randrange(2)
        old = info["data_offsets"][i]
        info["data_offsets"][i] = rng.choice([_number_forms(old, rng), -8 - n, -(n // 2), len(data), len(data) + 4])
        what = f"{key}.data_offsets[{i}] {old} -> {info['data_offsets'][i]!r}"
    elif how == "offsets_swap":
        other = rng.choice(keys)
        info["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], info["data_offsets"]
        what = f"swapped data_offsets of {key} and {other}"
    elif how == "shape":
        shape = info["shape"]
        choice = rng.randrange(6)
        if choice == 0 and shape:
            shape[rng.randrange(len(shape))] = _number_forms(shape[0], rng)
        elif choice == 1:
            shape.append(rng.choice([1, 1, 2, 0]))
        elif choice == 2 and shape:
            shape.pop(rng.randrange(len(shape)))
        elif choice == 3:
            shape.reverse()
        elif choice == 4:
            info["shape"] = rng.choice([None, "4", 4, {"0": 4}, [[4]]])
        else:
            info["shape"] = [x for d in shape for x in ((1, d) if rng.random() < 0.5 else (d,))]
        what = f"{key}.shape -> {info['shape']!r}"
    elif how == "dtype":
        info["dtype"] = rng.choice(SAFETENSORS_DTYPES + [{"F32": None}, {"F32": 1}, 32, None, ["F32"]])
        what = f"{key}.dtype -> {info['dtype']!r}"
    elif how == "field":
        field = rng.choice(["dtype", "shape", "data_offsets", "extra"])
        if field == "extra" or rng.random() < 0.3:
            info[rng.choice(["extra", "offsets", "Dtype"])] = rng.choice([1, "x", None, [1, 2], {"a": 1}])
            what = f"{key}: field added"
        else:
            del info[field]
            what = f"{key}: {field} removed"
    elif how == "form":
        header[key] = [info["dtype"], info["shape"], info["data_offsets"]][: rng.choice([3, 3, 2])]
        what = f"{key} as a list"
    elif how == "key":
        choice = rng.randrange(4)
        if choice == 0:
            header[key + rng.choice(["x", ".y", ""])] = header.pop(key)
            what = f"renamed {key}"
        elif choice == 1:
            del header[key]
            what = f"removed {key}"
        elif choice == 2:
            header[rng.choice(["extra", "__metadata__", ""])] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
            what = "added a zero-size key"
        else:
            text = text.replace(json.dumps(key).encode(), json.dumps(rng.choice(keys)).encode(), 1)
            return _join(text, data), f"text: {key} renamed to another key (a duplicate)"
    elif how == "metadata":
        header["__metadata__"] = rng.choice([None, {"format": "pt"}, {"a": 1}, [], "x", {"a": None}])
        what = f"__metadata__ -> {header['__metadata__']!r}"
    elif how == "length":
        delta = rng.choice([-8, -1, 1, 7, 8, 100, 2**40, 100_000_001 - n])
        return _join(text, data, max(n + delta, 0)), f"length prefix {n} -> {n + delta}"
    elif how == "number_text":
        digits = [i for i in range(len(text)) if chr(text[i]).isdigit() and not chr(text[i - 1]).isdigit()]
        if digits:
            at = rng.choice(digits)
            end = at
            while end < len(text) and chr(text[end]).isdigit():
                end += 1
            new = rng.choice([b"-0", b"1e1", b"8.0", b'"8"', b"true", b"null", b"NaN", b"Infinity", b"1e400",
                              b"9" * 30, b"9" * 400, b"-1", b"00", b"0x10", text[at:end] + b".0", text[at:end] + b"e0"])
            text = text[:at] + new + text[end:]
            return _join(text, data), f"number at {at} -> {new[:20]!r}"
        return _join(text, data), "no number"
    elif how == "padding":
        pad = rng.choice([b" " * 7, b"\t\n", b"\0" * 4, b"\x0c", b"\xef\xbb\xbf"])
        text = (pad + text) if rng.random() < 0.3 else (text + pad)
        return _join(text, data), f"padding {pad!r}"
    elif how == "nesting":
        depth = rng.choice([120, 125, 126, 127, 200, 3000])
        info["deep"] = None
        text = json.dumps(header).encode().replace(b'"deep": null', b'"deep": ' + b"[" * depth + b"]" * depth)
        return _join(text, data), f"{key}: nested {depth} deep"
    elif how == "data":
        k = rng.choice([1, 2, 4, 8])
        return (_join(text, data[:-k]) if rng.random() < 0.5 else _join(text, data + bytes(k))), f"data section +-{k}"
    else:
        out, what = bytes_mutation(blob, rng, (8, 8 + n))
        return out, f"header bytes: {what}"
    text = json.dumps(header, separators=rng.choice([(",", ":"), (", ", ": ")])).encode()
    return _join(text, data), what


# -- torch.save archives ---------------------------------------------------------


def _pickle_name(names):
    return next(n for n in names if n.endswith("data.pkl"))


def _text(value: str) -> bytes:
    return b"X" + struct.pack("<I", len(value)) + value.encode()


def _nesting(pkl: bytes, rng: random.Random) -> tuple[bytes, str]:
    """The state dict (memo 0, its items set by the final SETITEMS) nested in ways
    ``torch.load`` reads and ``load_checkpoint`` refuses (no one path of dotted
    keys per tensor, too deep, a tuple key); none deep enough to crash ``torch.load``."""
    how = rng.choice(["shared", "cycle", "deep tuple", "tuple key", "deep dicts"])
    body, end = pkl[2:-1], pkl[-2:]
    if how == "shared":  # {"a": sd, "b": sd}
        return b"\x80\x02}(" + _text("a") + body + _text("b") + b"h\x00u.", "pickle: the state dict under two keys"
    if how == "cycle":  # sd["self"] = sd
        return pkl[:-2] + _text("self") + b"h\x00" + end, "pickle: the state dict inside itself"
    if how == "deep tuple":  # sd[((...((),)...),)] = 1, nested past the scan's limit but not deep enough to crash
        depth = rng.choice([1001, 1500])
        return pkl[:-2] + b")" + b"\x85" * depth + b"K\x01" + end, f"pickle: a key of tuples {depth} deep"
    if how == "tuple key":  # sd[("x", 1)] = sd
        return pkl[:-2] + _text("x") + b"K\x01\x86h\x00" + end, "pickle: a tuple key"
    depth = rng.choice([101, 5000])  # sd["deep"] = {"k": {"k": ... None}}
    return (pkl[:-2] + _text("deep") + (b"}" + _text("k")) * depth + b"N" + b"s" * depth + end,
            f"pickle: dicts {depth} deep")


def pickle_mutation(pkl: bytes, rng: random.Random) -> tuple[bytes, str]:
    ops = []
    try:
        for op in pickletools.genops(pkl):
            ops.append(op)
    except Exception:  # noqa: BLE001 - an earlier mutation broke it: the ops before the damage
        pass
    ints = [(op, arg, pos) for op, arg, pos in ops if op.name in ("BININT1", "BININT2", "BININT")]
    strings = [(op, arg, pos) for op, arg, pos in ops if op.name == "BINUNICODE"]
    globals_ = [(op, arg, pos) for op, arg, pos in ops if op.name == "GLOBAL"]
    bools = [pos for op, arg, pos in ops if op.name in ("NEWTRUE", "NEWFALSE")]
    how = rng.choice(["int", "int", "int", "string", "global", "bool", "nesting", "bytes"])
    if how == "int" and ints:
        op, arg, pos = rng.choice(ints)
        width = {"BININT1": (1, "<B", 0, 255), "BININT2": (2, "<H", 0, 65535), "BININT": (4, "<i", -(2**31), 2**31 - 1)}[op.name]
        new = min(max(rng.choice([arg + 1, arg - 1, arg + 4, arg * 2, 0, 1, width[3], width[2], arg + 64, arg - 16]), width[2]), width[3])
        return pkl[:pos + 1] + struct.pack(width[1], new) + pkl[pos + 1 + width[0]:], f"pickle int at {pos}: {arg} -> {new}"
    if how == "string" and strings:
        op, arg, pos = rng.choice(strings)
        raw = arg.encode()
        new = bytes(rng.choice(b"0123abcX.") for _ in raw) if raw else b""
        return pkl[:pos + 5] + new + pkl[pos + 5 + len(raw):], f"pickle string at {pos}: {arg!r} -> {new!r}"
    if how == "global" and globals_:
        op, arg, pos = rng.choice(globals_)
        module, name = arg.split(" ")
        new_name = rng.choice(STORAGE_TYPES) if name.endswith("Storage") else rng.choice(
            [b"_rebuild_tensor", b"_rebuild_tensor_v2", b"_rebuild_sparse_tensor", b"_rebuild_qtensor", b"OrderedDict", b"Tensor", b"eval"])
        end = pkl.index(b"\n", pkl.index(b"\n", pos + 1) + 1) + 1
        new = b"c" + module.encode() + b"\n" + new_name + b"\n"
        return pkl[:pos] + new + pkl[end:], f"pickle global at {pos}: {arg} -> {new_name.decode()}"
    if how == "bool" and bools:
        pos = rng.choice(bools)
        return pkl[:pos] + bytes([pkl[pos] ^ 1]) + pkl[pos + 1:], f"pickle bool at {pos} flipped"
    if how == "nesting" and pkl.startswith(b"\x80\x02}q\x00") and pkl.endswith(b"u."):
        return _nesting(pkl, rng)
    out, what = bytes_mutation(pkl, rng)
    return out, f"pickle bytes: {what}"


def torch_mutation(blob: bytes, rng: random.Random) -> tuple[bytes, str]:
    try:
        zf = zipfile.ZipFile(io.BytesIO(blob))
        infos = zf.infolist()
        records = {i.filename: zf.read(i) for i in infos}
        pkl_name = _pickle_name(records)
    except Exception:  # noqa: BLE001 - already broken
        return bytes_mutation(blob, rng)
    names = [i.filename for i in infos]
    prefix = pkl_name[: -len("data.pkl")]
    storages = [n for n in records if n.startswith(prefix + "data/")]
    how = rng.choice(["pickle", "pickle", "pickle", "record_size", "record_swap", "byteorder", "version", "names",
                      "fields", "fields", "fields", "rezip", "bytes"])
    if how == "pickle":
        new, what = pickle_mutation(records[pkl_name], rng)
        if len(new) == len(records[pkl_name]) and rng.random() < 0.8:
            return crc_patch(blob, pkl_name, new), f"{what} (in place, CRC fixed)"
        records[pkl_name] = new
        return rezip(names, records), f"{what} (re-zipped)"
    if how == "record_size" and storages:
        name = rng.choice(storages)
        k = rng.choice([1, 2, 4, 8, 16])
        records[name] = records[name][:-k] if rng.random() < 0.6 else records[name] + bytes(k)
        return rezip(names, records), f"{name} resized by {k}"
    if how == "record_swap" and len(storages) > 1:
        a, b = rng.sample(storages, 2)
        records[a], records[b] = records[b], records[a]
        return rezip(names, records), f"swapped {a} and {b}"
    if how == "byteorder":
        name = prefix + "byteorder"
        new = rng.choice([b"big", b"little", b"BIG", b"middle", b"", None])
        if new is None:
            names = [n for n in names if n != name]
        else:
            records[name] = new
            names = names if name in names else names + [name]
        return rezip(names, records), f"byteorder -> {new!r}"
    if how == "version":
        name = prefix + "version"
        records[name] = rng.choice([b"3\n", b"0\n", b"11\n", b" 7", b"-1", b"x", b"", b"10", b"+2", b"2abc", b"99999999999999999999999"])
        return rezip(names, records), f"version -> {records[name]!r}"
    if how == "names":
        return rezip_names(infos, records, prefix, rng)
    if how == "fields":
        return zip_fields(blob, rng)
    if how == "rezip":
        method = rng.choice([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2])
        return rezip(names, records, method), f"re-zipped with method {method}"
    return bytes_mutation(blob, rng)


def rezip_names(infos, records, prefix, rng) -> tuple[bytes, str]:
    names = [i.filename for i in infos]
    choice = rng.randrange(6)
    victim = rng.choice(names)
    if choice == 0:
        new = victim.upper() if rng.random() < 0.5 else victim[: len(prefix)] + victim[len(prefix):].upper()
        order = [(new if n == victim else n) for n in names]
        data = {(new if n == victim else n): records[n] for n in names}
        what = f"renamed {victim} -> {new}"
    elif choice == 1:
        order = [n for n in names if n != victim]
        data = records
        what = f"removed {victim}"
    elif choice == 2:
        order = names + [victim]
        data = records
        what = f"{victim} twice"
    elif choice == 3:
        order = names + ["outside/" + victim.split("/")[-1]]
        data = dict(records, **{order[-1]: records[victim]})
        what = f"added {order[-1]}"
    elif choice == 4:
        order = [victim] + [n for n in names if n != victim]
        data = records
        what = f"{victim} first"
    else:
        new = "other/" + victim[len(prefix):]
        order = [(new if n == victim else n) for n in names]
        data = {(new if n == victim else n): records[n] for n in names}
        what = f"moved {victim} to {new}"
    return rezip(order, data), what


# -- folders with an index ------------------------------------------------------


def index_mutation(folder: str, secret: str, rng: random.Random) -> str:
    """Mutate the folder in place; return what was done."""
    index = next(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".index.json"))
    shards = sorted(n for n in os.listdir(folder) if not n.endswith(".json"))
    try:
        with open(index) as f:
            content = json.load(f)
        weight_map = content["weight_map"]
        assert isinstance(weight_map, dict) and weight_map
        key = rng.choice(sorted(weight_map))
        how = rng.choice(["value", "value", "key", "structure", "text", "shard", "shard", "shard", "link"])
    except Exception:  # noqa: BLE001 - an earlier mutation broke the index
        how = rng.choice(["text", "shard", "link"])
    if how == "value":
        weight_map[key] = rng.choice([
            "../" + os.path.basename(secret), secret, "missing.safetensors", 3, None, "", ".", "sub/../" + shards[0],
            shards[-1], shards[0], "./" + shards[0], os.path.join(os.path.abspath(folder), shards[0]),
        ])
        what = f"weight_map[{key!r}] -> {weight_map[key]!r}"
    elif how == "key":
        weight_map[key + "x"] = weight_map.pop(key) if rng.random() < 0.5 else weight_map[key]
        what = f"key {key!r} renamed or duplicated"
    elif how == "structure":
        content = rng.choice([[weight_map], {"weight_map": list(weight_map.items())}, {"weight_map": None},
                              {"metadata": {}}, {"weight_map": weight_map, "metadata": 1}, "x"])
        what = f"index -> {str(content)[:60]}"
    elif how == "text":
        with open(index, "rb") as f:
            blob = f.read()
        blob, what = bytes_mutation(blob, rng)
        with open(index, "wb") as f:
            f.write(blob)
        return f"index bytes: {what}"
    elif how == "shard":
        name = rng.choice(shards)
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            blob = f.read()
        blob, what = (safetensors_mutation if name.endswith(".safetensors") else torch_mutation)(blob, rng)
        with open(path, "wb") as f:
            f.write(blob)
        return f"shard {name}: {what}"
    else:
        name = rng.choice(shards)
        os.remove(os.path.join(folder, name))
        target = secret if rng.random() < 0.6 else os.path.join(os.path.abspath(folder), rng.choice(shards))
        if target.endswith(name):
            target = secret
        os.symlink(target, os.path.join(folder, name))
        return f"{name} -> symlink to {target}"
    with open(index, "w") as f:
        json.dump(content, f)
    return what


# -- distributed checkpoints ----------------------------------------------------------

# A field set to this string is replaced, in the pickled metadata, by hostile pickle bytes.
_PLACEHOLDER = "PLACEHOLDER-of-the-fuzzer"
_DTYPES = [torch.float64, torch.float16, torch.int32, torch.bool, torch.complex64, torch.uint8, torch.bfloat16]


def _hostile_value(rng: random.Random) -> tuple[bytes, str]:
    """Pickle bytes (protocol 2 to 4) of one value: a deep tuple, tuples sharing
    tuples through the memo (memo indices far from the pickle's own), deep lists."""
    how = rng.choice(["deep tuple", "shared tuples", "deep list", "long tuple"])
    if how == "deep tuple":
        n = rng.choice([1001, 100_000, 1_000_000])
        return b")" + b"\x85" * n, f"a tuple nested {n} deep"
    if how == "shared tuples":
        levels = rng.choice([30, 64])
        base = 1 << 20
        out = b")" + b"r" + struct.pack("<I", base)
        for i in range(levels):
            out += b"j" + struct.pack("<I", base + i) + b"j" + struct.pack("<I", base + i) + b"\x86r" + struct.pack("<I", base + i + 1)
        return out, f"tuples sharing tuples {levels} levels deep"
    if how == "deep list":
        n = rng.choice([1000, 200_000])
        return b"]" * n + b"a" * (n - 1), f"a list nested {n} deep"
    n = rng.choice([10, 100_000])
    return b"(" + b"K\x01" * n + b"t", f"a tuple of {n} ones"


def _metadata_bytes(meta, hostile: bytes | None = None) -> bytes:
    """``meta`` pickled as dcp.save pickles it, or (``hostile``) in protocol 2 (no
    frames) with the placeholder's string replaced by ``hostile``."""
    if hostile is None:
        return pickle.dumps(meta)
    text = _PLACEHOLDER.encode()
    return pickle.dumps(meta, protocol=2).replace(b"X" + struct.pack("<I", len(text)) + text, hostile, 1)


def _storage_items(meta) -> list:
    return sorted(meta.storage_data.items(), key=lambda kv: (kv[0].fqn, tuple(kv[0].offset or ())))


def dcp_mutation(folder: str, state: dict, secret: str, rng: random.Random) -> str:
    """Mutate the distributed checkpoint ``folder`` in place; return what was done.
    ``state["meta"]`` is its metadata as a ``Metadata`` object (None once an
    earlier mutation left bytes no object stands for); ``secret`` is a file
    outside the folder."""
    try:
        return _dcp_mutation(folder, state, secret, rng)
    except Exception as e:  # noqa: BLE001 - an earlier mutation left what this one cannot change: bytes
        state["meta"] = None
        return f"({type(e).__name__}) " + _dcp_mutation(folder, state, secret, rng)


def _dcp_mutation(folder: str, state: dict, secret: str, rng: random.Random) -> str:
    import torch.distributed.checkpoint.metadata as md

    path = os.path.join(folder, ".metadata")
    chunks = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))
    meta = state.get("meta")
    kinds = ["offset", "length", "path", "dtype", "shape", "chunk", "chunk", "key", "item", "index", "hostile",
             "archive", "archive", "archive", "metadata bytes", "chunk bytes", "link"]
    how = rng.choice(kinds if meta is not None else ["metadata bytes", "chunk bytes", "link"])
    if how in ("metadata bytes", "chunk bytes"):
        target = path if how == "metadata bytes" or not chunks else os.path.join(folder, rng.choice(chunks))
        with open(target, "rb") as f:
            blob = f.read()
        blob, what = bytes_mutation(blob, rng)
        with open(target, "wb") as f:
            f.write(blob)
        if target == path:
            state["meta"] = None
        return f"{os.path.basename(target)} bytes: {what}"
    if how == "link":
        # A file moved out of the folder (or beside itself) and a symbolic link left in its place.
        name = ".metadata" if rng.random() < 0.5 or not chunks else rng.choice(chunks)
        outside = rng.random() < 0.7
        target = os.path.join(os.path.dirname(secret), name) if outside else os.path.join(folder, name + ".real")
        os.replace(os.path.join(folder, name), target)
        os.symlink(target, os.path.join(folder, name))
        return f"{name} -> symlink to {target}"
    items = _storage_items(meta)
    index, info = rng.choice(items) if items else (None, None)
    keys = sorted(k for k, v in meta.state_dict_metadata.items() if isinstance(v, md.TensorStorageMetadata))
    key = rng.choice(keys) if keys else None
    hostile = None
    if how in ("offset", "length") and info is not None:
        size = os.path.getsize(os.path.join(folder, info.relative_path))
        old = getattr(info, how)
        new = rng.choice([old + 1, old - 1, old + rng.randrange(1, 64), 0, size, size - old, 1 << 62, -5, "12", None, 1.5])
        setattr(info, how, new)
        what = f"{index.fqn} {how} {old} -> {new!r}"
    elif how == "path" and info is not None:
        new = rng.choice(["../" + os.path.basename(secret), secret, "/etc/passwd", "missing.distcp", "", ".", 7, None,
                          "sub/../" + info.relative_path, "./" + info.relative_path, *chunks])
        info.relative_path = new
        what = f"{index.fqn} relative_path -> {new!r}"
    elif how == "dtype" and key is not None:
        new = rng.choice(_DTYPES + ["float32", None])
        meta.state_dict_metadata[key].properties.dtype = new
        what = f"{key} dtype -> {new}"
    elif how == "shape" and key is not None:
        item = meta.state_dict_metadata[key]
        size = list(item.size)
        choice = rng.choice(["grow", "shrink", "zero", "huge", "extra", "drop", "type"])
        if choice in ("grow", "shrink", "zero", "huge") and size:
            d = rng.randrange(len(size))
            size[d] = {"grow": size[d] + 1, "shrink": max(size[d] - 1, 0), "zero": 0, "huge": 1 << 62}[choice]
        elif choice == "extra":
            size.append(1)
        elif choice == "drop" and size:
            size.pop()
        item.size = torch.Size(size) if choice != "type" else [float(n) for n in size]
        what = f"{key} size -> {item.size}"
    elif how == "chunk" and key is not None:
        item = meta.state_dict_metadata[key]
        choice = rng.choice(["offsets", "sizes", "duplicate", "remove", "swap"])
        c = rng.randrange(len(item.chunks)) if item.chunks else None
        if choice in ("offsets", "sizes") and c is not None:
            values = list(getattr(item.chunks[c], choice))
            if values:
                d = rng.randrange(len(values))
                values[d] = rng.choice([values[d] + 1, max(values[d] - 1, 0), 0, 1 << 40])
            setattr(item.chunks[c], choice, torch.Size(values))
        elif choice == "duplicate" and c is not None:
            item.chunks.append(item.chunks[c])
        elif choice == "remove" and c is not None:
            item.chunks.pop(c)
        elif choice == "swap" and len(keys) > 1:
            other = meta.state_dict_metadata[rng.choice([k for k in keys if k != key])]
            item.chunks, other.chunks = other.chunks, item.chunks
        what = f"{key} chunks: {choice} {c}"
    elif how == "key" and key is not None:
        new = key + rng.choice(["x", ".weight", ""]) if rng.random() < 0.7 else rng.choice(keys)
        meta.state_dict_metadata[new] = meta.state_dict_metadata.pop(key) if rng.random() < 0.5 else meta.state_dict_metadata[key]
        what = f"key {key} -> {new}"
    elif how == "item" and key is not None:
        new = rng.choice([md.BytesStorageMetadata(), None, [], md.TensorStorageMetadata(
            md.TensorProperties(torch.float32), torch.Size([2]), [])])
        meta.state_dict_metadata[key] = new
        what = f"{key} -> {type(new).__name__}"
    elif how == "index" and index is not None:
        meta.storage_data.pop(index)
        offset = list(index.offset or ())
        if offset and rng.random() < 0.7:
            offset[rng.randrange(len(offset))] += 1
        new = md.MetadataIndex(rng.choice([index.fqn, index.fqn + "x"]), offset)
        meta.storage_data[new] = info
        what = f"storage index {index} -> {new}"
    elif how == "hostile":
        hostile, what = _hostile_value(rng)
        targets = [(info, "offset"), (info, "relative_path")] if info is not None else []
        if key is not None:
            targets += [(meta.state_dict_metadata[key], "size"), (meta.state_dict_metadata[key].properties, "dtype")]
        obj, field = rng.choice(targets) if targets else (meta, "planner_data")
        setattr(obj, field, _PLACEHOLDER)
        what = f"{type(obj).__name__}.{field} -> {what}"
        state["meta"] = None
    elif how == "archive" and info is not None and info.relative_path in chunks and type(info.offset) is type(info.length) is int:
        # A chunk's torch.save archive mutated, written at the end of its file.
        file = os.path.join(folder, info.relative_path)
        with open(file, "rb") as f:
            data = f.read()
        archive = data[info.offset : info.offset + info.length]
        new, what = torch_mutation(archive, rng)
        with open(file, "ab") as f:
            f.write(new)
        info.offset, info.length = len(data), len(new)
        what = f"{index.fqn}'s chunk archive: {what}"
    else:
        return "nothing"
    with open(path, "wb") as f:
        f.write(_metadata_bytes(meta, hostile))
    return what
