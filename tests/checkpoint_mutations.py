"""Seeds and mutations for the checkpoint fuzzer (tests/materialize/test_checkpoint_fuzz.py).

Seeds are valid checkpoints of :class:`checkpoint_fuzz_worker.Holder`'s keys:
a safetensors file; ``torch.save`` archives (torch's own layout with tensors
that are strided views sharing storages, the same re-zipped by ``zipfile``
stored and deflated, a big-endian one, and the same as a legacy non-zip file); folders with an index over two
safetensors shards and over two ``torch.save`` shards.

A mutant is a seed after one to three mutations drawn from a seeded
``random.Random``; each mutation returns a description, so a failure names
exactly what was done.  Mutations know the formats: safetensors headers
(offsets, shapes, dtypes, fields, keys, ``__metadata__``, the length prefix,
JSON number forms, padding, nesting), zip archives (records shortened,
swapped, renamed, removed, added, re-zipped; central-directory, local-header
and end-record fields; the pickle's integers, keys, storage types and bytes
with its CRC fixed; the state dict shared, cyclic, nested too deep or keyed
by tuples nested too deep; ``byteorder``; ``version``), legacy (non-zip)
``torch.save`` files (their object pickle, storage counts, truncation),
index files (names leaving
the folder, missing files, wrong types, symbolic links); and plain bytes
(truncation, bit flips, insertions, deletions, garbage appended).
"""

from __future__ import annotations

import io
import json
import os
import pickletools
import random
import struct
import zipfile

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



# -- legacy torch.save files ------------------------------------------------------


def legacy_parts(blob: bytes) -> list:
    """The spans of a legacy file's five pickles, then ``(count, data)`` spans of its storages."""
    f = io.BytesIO(blob)
    spans = []
    for _ in range(5):
        start = f.tell()
        for _op in pickletools.genops(f):
            pass
        spans.append((start, f.tell()))
    return spans


def legacy_mutation(blob: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A legacy (non-zip) ``torch.save`` file's object pickle, storage counts or storage bytes changed."""
    try:
        spans = legacy_parts(blob)
    except Exception:  # noqa: BLE001 - already broken
        return bytes_mutation(blob, rng)
    start, end = spans[3]
    how = rng.choice(["pickle", "pickle", "pickle", "count", "truncate", "keys"])
    if how == "pickle":
        new, what = pickle_mutation(blob[start:end], rng)
        return blob[:start] + new + blob[end:], f"legacy object {what}"
    data_at = spans[4][1]
    if how == "count" and len(blob) >= data_at + 8:
        count = struct.unpack_from("<q", blob, data_at)[0]
        new = rng.choice([count + 1, count - 1, 0, 2 * count, 2**40, -1])
        return blob[:data_at] + struct.pack("<q", new) + blob[data_at + 8:], f"legacy first storage count {count} -> {new}"
    if how == "keys":
        k0, k1 = spans[4]
        new, what = pickle_mutation(blob[k0:k1], rng)
        return blob[:k0] + new + blob[k1:], f"legacy keys {what}"
    cut = rng.randrange(data_at, len(blob))
    return blob[:cut], f"legacy truncated at {cut} of {len(blob)}"
