"""Checkpoint files are untrusted input (issue 18): one test per way a file
no one here wrote used to be trusted.

Each compares with the reference loader (``safetensors.torch.load_file``,
``torch.load(weights_only=True)`` and ``load_state_dict``): a file it
refuses is refused with ``CheckpointError`` at ``load_checkpoint``, naming
the file and what is wrong, and neither a deferred nor a real module
changes; a file it reads gives the same values.
"""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
from safetensors.torch import load_file, save_file

from deferinit import CheckpointNotFoundError, deferred_init
from deferinit.materialize import load_checkpoint, materialize_module

from checkpoint_refusals import build, refused, state_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def loads_as(source, reference: dict, ctor=build):
    """``load_checkpoint`` gives what ``load_state_dict(reference)`` gives, deferred and real."""
    expected = ctor()
    expected.load_state_dict(reference)
    deferred = deferred_init(ctor)
    load_checkpoint(deferred, source)
    real = ctor()
    load_checkpoint(real, source)
    for m in (materialize_module(deferred), real):
        for k, v in m.state_dict().items():
            assert torch.equal(v, expected.state_dict()[k]), k


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


# -- index files ------------------------------------------------------------------


def _sharded(folder, names=("a.safetensors", "b.safetensors")):
    sd = state_dict()
    folder.mkdir()
    keys = sorted(sd)
    save_file({k: sd[k] for k in keys[:2]}, folder / names[0])
    save_file({k: sd[k] for k in keys[2:]}, folder / names[1])
    weight_map = {k: names[0] for k in keys[:2]} | {k: names[1] for k in keys[2:]}
    return sd, weight_map


def _write_index(folder, content):
    (folder / "model.safetensors.index.json").write_text(json.dumps(content))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_naming_a_file_outside_the_folder_is_refused(tmp_path, how):
    sd, weight_map = _sharded(tmp_path / "ckpt")
    other = tmp_path / "other"
    other.mkdir()
    save_file({k: torch.full_like(v, 7.0) for k, v in sd.items()}, other / "secret.safetensors")
    key = sorted(sd)[0]
    if how == "dotdot":
        weight_map[key] = "../other/secret.safetensors"
    elif how == "absolute":
        weight_map[key] = str(other / "secret.safetensors")
    else:
        os.remove(tmp_path / "ckpt" / "a.safetensors")
        os.symlink(other / "secret.safetensors", tmp_path / "ckpt" / "a.safetensors")
    _write_index(tmp_path / "ckpt", {"weight_map": weight_map})
    error = refused(tmp_path / "ckpt", "outside .*ckpt: only files inside the folder are read")
    assert "model.safetensors.index.json" in str(error) and repr(key) in str(error)


def test_a_folder_without_index_does_not_follow_a_link_out(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(state_dict(), tmp_path / "secret.safetensors")
    os.symlink(tmp_path / "secret.safetensors", folder / "model.safetensors")
    refused(folder, "symbolic link to .*secret.safetensors, outside")


def test_links_inside_the_folder_and_into_the_hub_cache_are_followed(tmp_path):
    sd, weight_map = _sharded(tmp_path / "ckpt")
    os.rename(tmp_path / "ckpt" / "b.safetensors", tmp_path / "ckpt" / "real-b.safetensors")
    os.symlink("real-b.safetensors", tmp_path / "ckpt" / "b.safetensors")
    _write_index(tmp_path / "ckpt", {"weight_map": weight_map})
    loads_as(tmp_path / "ckpt", sd)
    # huggingface_hub's cache: snapshots/<revision>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    save_file(sd, repo / "blobs" / "0123abcd")
    os.symlink("../../blobs/0123abcd", repo / "snapshots" / "abc123" / "model.safetensors")
    loads_as(repo / "snapshots" / "abc123", sd)


@pytest.mark.parametrize(
    "content, match",
    [
        ([{"weight_map": {}}], "is a JSON list, not an object"),
        ({"weight_map": [["0.weight", "a.safetensors"]]}, "has a list 'weight_map'"),
        ({"metadata": {}}, "has no 'weight_map'"),
        ({"weight_map": {"0.weight": 3}}, "puts '0.weight' in 3, not a file name"),
        ({"weight_map": {"0.weight": None}}, "puts '0.weight' in None, not a file name"),
        ({"weight_map": {"0.weight": ""}}, "names '', not a file name"),
    ],
)
def test_malformed_index_is_refused_naming_it(tmp_path, content, match):
    _sharded(tmp_path / "ckpt")
    _write_index(tmp_path / "ckpt", content)
    error = refused(tmp_path / "ckpt", match)
    assert "model.safetensors.index.json" in str(error)


# -- safetensors headers --------------------------------------------------------------


def _one_tensor(tmp_path, offsets, data_len=48):
    header = {"0.weight": {"dtype": "F32", "shape": [4, 3], "data_offsets": offsets}}
    path = tmp_path / "bad.safetensors"
    path.write_bytes(safetensors_bytes(header, bytes(range(data_len))))
    with pytest.raises(Exception):  # the reference refuses it too
        load_file(path)
    return path


@pytest.mark.parametrize("offsets", [[-48, 0], [-8, 40], [-100, -52]], ids=["before-data", "straddling", "in-header"])
def test_offsets_pointing_into_the_header_are_refused(tmp_path, offsets):
    path = _one_tensor(tmp_path, offsets)
    refused(path, r"bad.safetensors is not a valid safetensors file: .*invalid value: integer `-\d+`, expected usize")


@pytest.mark.parametrize(
    "offsets, match",
    [
        (["0", "48"], "invalid type: string \"0\", expected usize"),
        ([0.0, 48.0], "invalid type: floating point `0.0`, expected usize"),
        ([False, True], "invalid type: boolean `false`, expected usize"),
        ([0, 48, 48], "invalid length 3, expected 2 elements"),
        ([8, 56], "invalid offset for tensor `0.weight`"),
        ([0, 44], "invalid shape, data type, or offset for tensor"),
    ],
    ids=["strings", "floats", "booleans", "three", "gap", "short"],
)
def test_offsets_of_the_wrong_kind_are_refused_at_load_time(tmp_path, offsets, match):
    path = _one_tensor(tmp_path, offsets, data_len=56 if offsets == [8, 56] else 48)
    refused(path, match)


def test_second_tensor_bad_leaves_a_real_module_untouched(tmp_path):
    sd = state_dict()
    save_file(sd, tmp_path / "good.safetensors")
    blob = (tmp_path / "good.safetensors").read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    header[last]["data_offsets"] = [float(x) for x in header[last]["data_offsets"]]
    (tmp_path / "bad.safetensors").write_bytes(safetensors_bytes(header, blob[8 + n:]))
    refused(tmp_path / "bad.safetensors", "invalid type: floating point")


# -- torch.save archives ----------------------------------------------------------------


def _rezip(src, dst, method=zipfile.ZIP_STORED, edit=lambda name, data: data, zip64=False):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", method) as zout:
        for info in zin.infolist():
            new = zipfile.ZipInfo(info.filename)
            new.compress_type = method
            with zout.open(new, "w", force_zip64=zip64) as member:
                member.write(edit(info.filename, zin.read(info)))


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED, "zip64"], ids=["stored", "deflated", "zip64"])
def test_an_archive_rezipped_by_a_zip_tool_loads_as_torch_load(tmp_path, method):
    sd = state_dict()
    big = torch.randn(4, 4)  # views sharing one storage, at offsets
    sd["0.weight"], sd["0.bias"] = big[:, 1:], big[:, 0]
    torch.save(sd, tmp_path / "model.pt")
    if method == "zip64":  # zip64 extra fields in every local header
        _rezip(tmp_path / "model.pt", tmp_path / "rezipped.pt", zip64=True)
    else:
        _rezip(tmp_path / "model.pt", tmp_path / "rezipped.pt", method)
        assert {i.compress_type for i in zipfile.ZipFile(tmp_path / "rezipped.pt").infolist()} == {method}
    reference = torch.load(tmp_path / "rezipped.pt", map_location="cpu", weights_only=True)
    loads_as(tmp_path / "rezipped.pt", reference)


def test_a_storage_record_shorter_than_the_pickle_says_is_refused(tmp_path):
    torch.save(state_dict(), tmp_path / "model.pt")
    _rezip(tmp_path / "model.pt", tmp_path / "short.pt", edit=lambda n, d: d[:-4] if n.endswith("data/0") else d)
    with pytest.raises(RuntimeError, match="size"):
        torch.load(tmp_path / "short.pt", map_location="cpu", weights_only=True)
    refused(tmp_path / "short.pt", r"short.pt is not a torch.save archive .*record '.*data/0' has \d+ bytes, its pickle says")


def test_a_storage_record_longer_than_the_pickle_says_is_refused(tmp_path):
    """A record with more bytes than its storage: torch 2.15 refuses it ("record
    size (52 bytes) does not match expected size"); 2.13 and 2.14 take its first
    bytes.  load_checkpoint refuses it on every torch, naming the file and the
    record."""
    sd = state_dict()
    torch.save(sd, tmp_path / "model.pt")
    _rezip(tmp_path / "model.pt", tmp_path / "long.pt", edit=lambda n, d: d + bytes(4) if n.endswith("data/0") else d)
    try:
        loaded = torch.load(tmp_path / "long.pt", map_location="cpu", weights_only=True)
    except RuntimeError as e:  # torch >= 2.15
        assert "size" in str(e)
    else:  # torch < 2.15: the storage is the record's first bytes
        assert all(torch.equal(loaded[k], v) for k, v in sd.items())
    refused(tmp_path / "long.pt", r"long.pt is not a torch.save archive .*record '.*data/0' has 52 bytes, its pickle says 48")


@pytest.mark.parametrize("other", ["0.weight", "0.bias"], ids=["other_size", "same_size"])
def test_a_record_read_with_two_dtypes_is_refused(tmp_path, other):
    """The checkpoint fuzzer's mutant #663: one pickle string changed, so that a
    float64 storage of 2 elements (16 bytes) names the record of a float32
    tensor.  torch 2.13 gives it the float32 storage loaded first; torch 2.15
    reinterprets it as float64 when the sizes agree and refuses it when they
    do not ("record size (48 bytes) does not match expected size").  torch.save
    writes one dtype per record that holds bytes, so load_checkpoint refuses
    it, naming the file and the record (the reader before the one core loaded
    it as 2.13 does)."""
    sd = state_dict()
    sd["1.bias"] = sd["1.bias"].double()
    torch.save(sd, tmp_path / "model.pt")
    keys = {name: str(i) for i, name in enumerate(sd)}  # torch.save numbers storages in order

    def point(name, data):
        if not name.endswith("data.pkl"):
            return data
        head, tail = data.split(b"DoubleStorage", 1)
        old, new = keys["1.bias"].encode(), keys[other].encode()
        assert tail.count(b"X\x01\x00\x00\x00" + old) >= 1
        return head + b"DoubleStorage" + tail.replace(b"X\x01\x00\x00\x00" + old, b"X\x01\x00\x00\x00" + new, 1)

    _rezip(tmp_path / "model.pt", tmp_path / "two.pt", edit=point)
    try:
        loaded = torch.load(tmp_path / "two.pt", map_location="cpu", weights_only=True)
    except RuntimeError as e:  # torch >= 2.15, sizes differing
        assert "size" in str(e)
    else:
        assert loaded["1.bias"].untyped_storage().data_ptr() == loaded[other].untyped_storage().data_ptr()
    refused(tmp_path / "two.pt", rf"two.pt is not a torch.save archive .*record 'data/{keys[other]}' is read as torch.float32 .* and as torch.float64")


def test_a_big_endian_archive_loads_as_torch_load_in_a_child_process(tmp_path):
    """``torch.load(map_location="meta")``, used to read archives before, died of
    SIGSEGV on these: the check runs where a crash cannot take the tests down."""
    script = textwrap.dedent(
        f"""
        import sys, zipfile, torch
        sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}, {os.path.join(ROOT, 'tests', 'materialize')!r}]
        import test_checkpoint_untrusted as t
        sd = t.state_dict()
        sd["c"] = torch.randn(3, dtype=torch.complex64)
        torch.save(sd, {str(tmp_path / 'little.pt')!r})

        def swap(name, data):
            if name.endswith("byteorder"):
                return b"big"
            if "/data/" in name:
                return b"".join(data[i:i + 4][::-1] for i in range(0, len(data), 4))
            return data

        t._rezip({str(tmp_path / 'little.pt')!r}, {str(tmp_path / 'big.pt')!r}, edit=swap)
        reference = torch.load({str(tmp_path / 'big.pt')!r}, map_location="cpu", weights_only=True)
        assert all(torch.equal(reference[k], sd[k]) for k in sd)  # the swap undone, complex halves apart

        def ctor():
            m = t.build()
            m.register_buffer("c", torch.zeros(3, dtype=torch.complex64))
            return m

        t.loads_as({str(tmp_path / 'big.pt')!r}, reference, ctor)
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stdout, done.stderr[-3000:])


# -- missing files ---------------------------------------------------------------------


def test_a_missing_file_is_also_a_file_not_found_error(tmp_path):
    path = tmp_path / "nothing.safetensors"
    error = refused(path, "no checkpoint at .*nothing.safetensors: no such file or directory")
    assert isinstance(error, FileNotFoundError) and isinstance(error, CheckpointNotFoundError)
    assert error.errno == errno.ENOENT and error.filename == str(path)
    with pytest.raises(FileNotFoundError):  # what code written for torch.load catches
        load_checkpoint(build(), str(tmp_path / "nothing.pt"))


def test_an_index_naming_a_missing_file_raises_file_not_found(tmp_path):
    sd, weight_map = _sharded(tmp_path / "ckpt")
    os.remove(tmp_path / "ckpt" / "b.safetensors")
    _write_index(tmp_path / "ckpt", {"weight_map": weight_map})
    error = refused(tmp_path / "ckpt", r"index .*model.safetensors.index.json puts '.*' in b.safetensors, which does not exist")
    assert isinstance(error, FileNotFoundError) and error.filename.endswith("b.safetensors")


# -- zip structures torch.load's reader refuses or reads otherwise (found by the fuzzer) --


def _patched(path, how):
    """A torch.save archive with one structure changed as ``how`` says."""
    from checkpoint_zip import entries

    blob = bytearray(path.read_bytes())
    members = {name.decode(): (cd, local) for cd, name, local, *_ in entries(bytes(blob))}
    if how in ("zip64 locator past the end", "zip64 locator astray"):
        # miniz follows the pointer (past the end: refused; elsewhere: it reads the
        # plain end record instead), zipfile reads the zip64 record before the locator
        at = blob.rindex(b"PK\x06\x07") + 8
        offset = len(blob) if how.endswith("end") else int.from_bytes(blob[at:at + 8], "little") - 8
        blob[at:at + 8] = offset.to_bytes(8, "little")
    elif how == "directory offset":  # zipfile finds the directory anyway, miniz does not
        at = blob.rindex(b"PK\x06\x06") + 48
        blob[at:at + 8] = (int.from_bytes(blob[at:at + 8], "little") - 1).to_bytes(8, "little")
    elif how == "directory attribute":  # miniz reads nothing for a directory
        cd = next(cd for name, (cd, _) in members.items() if name.endswith(".storage_alignment"))
        blob[cd + 38] |= 0x10
    elif how == "name not UTF-8":
        cd = next(cd for name, (cd, _) in members.items() if name.endswith("version"))
        blob[cd + 46 + 2] = 0xFF
    return bytes(blob)


@pytest.mark.parametrize("how", ["zip64 locator past the end", "directory offset", "directory attribute", "name not UTF-8"])
def test_zip_structures_torch_load_refuses_are_refused(tmp_path, how):
    torch.save(state_dict(), tmp_path / "model.pt")
    (tmp_path / "bad.pt").write_bytes(_patched(tmp_path / "model.pt", how))
    if how != "directory attribute":  # there torch.load reads uninitialised memory instead
        with pytest.raises(Exception):
            torch.load(tmp_path / "bad.pt", map_location="cpu", weights_only=True)
    refused(tmp_path / "bad.pt", "bad.pt is not a torch.save archive that torch.load\\(weights_only=True\\) reads")


def test_a_zip64_locator_astray_with_a_plain_end_record_loads_as_torch_load(tmp_path):
    sd = state_dict()
    torch.save(sd, tmp_path / "model.pt")
    (tmp_path / "astray.pt").write_bytes(_patched(tmp_path / "model.pt", "zip64 locator astray"))
    loads_as(tmp_path / "astray.pt", torch.load(tmp_path / "astray.pt", map_location="cpu", weights_only=True))


def test_members_named_alike_but_for_case_load_as_torch_load(tmp_path):
    """PyTorch's reader finds a record without regard to case: the one it reads is
    the one read here (the records' positions come from it)."""
    torch.save(state_dict(), tmp_path / "model.pt")
    with zipfile.ZipFile(tmp_path / "model.pt") as zin, zipfile.ZipFile(tmp_path / "bad.pt", "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info))
            if info.filename.endswith("data/0"):
                zout.writestr(info.filename.replace("data/0", "DATA/0"), bytes(len(zin.read(info))))
    loads_as(tmp_path / "bad.pt", torch.load(tmp_path / "bad.pt", map_location="cpu", weights_only=True))


def test_a_corrupt_shard_is_named_with_the_index_and_key(tmp_path):
    sd, weight_map = _sharded(tmp_path / "ckpt")
    _write_index(tmp_path / "ckpt", {"weight_map": weight_map})
    with open(tmp_path / "ckpt" / "b.safetensors", "r+b") as f:
        f.truncate(os.path.getsize(tmp_path / "ckpt" / "b.safetensors") - 1)
    key = next(k for k, v in weight_map.items() if v == "b.safetensors")
    refused(tmp_path / "ckpt", rf"b.safetensors is not a valid safetensors file: .*file not fully covered.* \(the index .*model.safetensors.index.json names it for {key!r}\)")


def test_a_deflated_record_shorter_than_its_directory_entry_says_is_refused(tmp_path):
    """zipfile stops where the deflate stream ends; torch.load's reader wants the size."""
    from checkpoint_zip import entries

    torch.save(state_dict(), tmp_path / "model.pt")
    _rezip(tmp_path / "model.pt", tmp_path / "deflated.pt", zipfile.ZIP_DEFLATED)
    blob = bytearray((tmp_path / "deflated.pt").read_bytes())
    cd = next(cd for cd, name, *_ in entries(bytes(blob)) if name.endswith(b".storage_alignment"))
    blob[cd + 24] += 4  # its size: 2 -> 6
    (tmp_path / "bad.pt").write_bytes(bytes(blob))
    with pytest.raises(RuntimeError, match="unexpected decompressed size"):
        torch.load(tmp_path / "bad.pt", map_location="cpu", weights_only=True)
    refused(tmp_path / "bad.pt", r"record '.storage_alignment' does not inflate to its 6 bytes")


def _deflated_with(tmp_path, record: str, how) -> str:
    """A deflated copy of a ``torch.save`` archive whose record ``record`` (or its
    directory entry) ``how(blob, info, start)`` damaged."""
    torch.save(state_dict(), tmp_path / "model.pt")
    _rezip(tmp_path / "model.pt", tmp_path / "deflated.pt", zipfile.ZIP_DEFLATED)
    blob = bytearray((tmp_path / "deflated.pt").read_bytes())
    info = next(i for i in zipfile.ZipFile(tmp_path / "deflated.pt").infolist() if i.filename.endswith(record))
    how(blob, info, info.header_offset + 30 + len(info.filename) + len(info.extra))
    (tmp_path / "bad.pt").write_bytes(bytes(blob))
    return str(tmp_path / "bad.pt")


def _garbled(blob, info, start):
    blob[start] |= 0x06  # the first block's type: reserved, so the stream does not inflate


def _pointed_at_the_first_record(blob, info, start):
    from checkpoint_zip import entries

    cd = next(cd for cd, name, *_ in entries(bytes(blob)) if name == info.filename.encode())
    blob[cd + 42: cd + 46] = struct.pack("<I", 0)  # its local header offset: another record's


@pytest.mark.parametrize("record,how", [
    ("data.pkl", _garbled), (".data/serialization_id", _garbled), ("byteorder", _garbled),
    (".data/serialization_id", _pointed_at_the_first_record),
], ids=["data.pkl garbled", "serialization_id garbled", "byteorder garbled", "serialization_id elsewhere"])
def test_a_record_torch_reads_from_uninitialised_memory_is_refused_every_time(tmp_path, record, how):
    """PyTorch's reader checks no CRC and ignores a failed inflate: a record whose
    deflate stream is damaged, or whose directory entry points at another
    record's header, gives uninitialised memory, so ``torch.load``'s verdict on
    the file changes from run to run (found by the fuzzer's long profile: the
    reference refused, ``load_checkpoint`` loaded).  Refused every time, naming
    the record."""
    path = _deflated_with(tmp_path, record, how)
    for _ in range(3):
        refused(path, rf"record '{record}' does not inflate")
