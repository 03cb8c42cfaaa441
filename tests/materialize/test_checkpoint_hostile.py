"""Hostile ``torch.save`` files and file kinds (issue 18 item 1): pickles that
crash PyTorch's unpickler, nested dicts that make unbounded work of naming
the tensors, the legacy (non-zip) format (refused: re-save it), and paths
that are not regular files.

Each builds the file, shows what ``torch.load(weights_only=True)`` does
with it (a crash runs in a child process), and requires ``load_checkpoint``
to refuse it with ``CheckpointError`` naming the file (the module, deferred
or real, unchanged), or to give ``torch.load``'s values.
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch
import torch.nn as nn

from deferinit import CheckpointError, deferred_init
from deferinit.materialize import load_checkpoint, materialize_module

from checkpoint_refusals import build, refused, state_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAGIC = 0x1950A86A20F9469CFC6C


def loads_as(source, reference: dict):
    """``load_checkpoint`` gives what ``load_state_dict(reference)`` gives, deferred and real."""
    expected = build()
    expected.load_state_dict(reference)
    deferred = deferred_init(build)
    load_checkpoint(deferred, source)
    real = build()
    load_checkpoint(real, source)
    for m in (materialize_module(deferred), real):
        for k, v in m.state_dict().items():
            assert torch.equal(v, expected.state_dict()[k]), k


def child(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``script`` run by a fresh interpreter importing this checkout."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def refusal_in_child(source: str, timeout: float) -> str:
    """What ``load_checkpoint(nn.Linear(2, 2), source)`` refuses with, in a fresh
    interpreter (a file that hangs or crashes a reader cannot take the tests down)."""
    done = child(f"""
        import torch
        from deferinit import CheckpointError
        from deferinit.materialize import load_checkpoint
        try:
            load_checkpoint(torch.nn.Linear(2, 2), {source!r})
        except CheckpointError as e:
            print(e)
    """, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def with_pickle(path, pkl: bytes) -> None:
    """A ``torch.save`` archive at ``path`` whose data.pkl is ``pkl`` (its other records those of a real one)."""
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buffer)
    src = zipfile.ZipFile(buffer)
    with zipfile.ZipFile(path, "w") as out:
        for name in src.namelist():
            out.writestr(name, pkl if name.endswith("/data.pkl") else src.read(name))


class _Storage:
    def __init__(self, key, storage_type, numel):
        self.key, self.storage_type, self.numel = key, storage_type, numel


class _Tensor:
    """Pickled as ``torch.save`` pickles a tensor, with whatever geometry it is given."""

    def __init__(self, storage, offset, size, stride):
        self.args = (storage, offset, size, stride)

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, self.args + (False, collections.OrderedDict())


class _LegacyPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", obj.storage_type, obj.key, "cpu", obj.numel, None)
        return None


def legacy_bytes(obj, storages, obj_pickle: bytes | None = None) -> bytes:
    """A legacy ``torch.save`` file (``_use_new_zipfile_serialization=False``)
    of ``obj``; ``storages``: ``[(_Storage, its bytes)]``, written in order
    with their element counts; ``obj_pickle``: raw bytes instead of ``obj``'s pickle."""
    out = io.BytesIO()
    for value in (MAGIC, 1001, {"protocol_version": 1001, "little_endian": True,
                                "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        pickle.dump(value, out, protocol=2)
    if obj_pickle is None:
        _LegacyPickler(out, protocol=2).dump(obj)
    else:
        out.write(obj_pickle)
    pickle.dump([s.key for s, _ in storages], out, protocol=2)
    for s, data in storages:
        out.write(s.numel.to_bytes(8, "little"))
        out.write(data)
    return out.getvalue()


# -- pickles that crash the unpickler -------------------------------------------------

# {((...((),)...),): 1}: a dict keyed by a tuple nested a million deep, 1 MB of TUPLE1.
DEEP_TUPLE_PICKLE = b"\x80\x02}(" + b")" + b"\x85" * 1_000_000 + b"K\x01u."


def test_tuples_nested_a_million_deep_crash_torch_load_and_are_refused(tmp_path):
    path = str(tmp_path / "deep.pt")
    with_pickle(path, DEEP_TUPLE_PICKLE)
    reference = child(f"import torch; torch.load({path!r}, weights_only=True)")
    assert reference.returncode < 0, (reference.returncode, reference.stderr[-500:])  # killed by SIGSEGV
    # In a child process too: without the scan, the crash would take pytest with it.
    ours = child(f"""
        import torch
        from deferinit import CheckpointError
        from deferinit.materialize import load_checkpoint
        m = torch.nn.Linear(2, 2)
        before = m.weight.clone()
        try:
            load_checkpoint(m, {path!r})
        except CheckpointError as e:
            assert {path!r} in str(e) and "nests tuples" in str(e), e
            assert torch.equal(m.weight, before)
            print("refused")
    """)
    assert ours.returncode == 0 and ours.stdout.strip() == "refused", (ours.returncode, ours.stderr[-2000:])


# -- nested dicts --------------------------------------------------------------------


def _nested_sd(sd):
    return {"0": {"weight": sd["0.weight"], "bias": sd["0.bias"]}, "1": {"weight": sd["1.weight"], "bias": sd["1.bias"]}}


def test_nested_dicts_load_as_their_dotted_keys(tmp_path):
    sd = state_dict()
    path = str(tmp_path / "nested.pt")
    torch.save(_nested_sd(sd), path)
    loaded = torch.load(path, weights_only=True)
    reference = {f"{a}.{b}": t for a, inner in loaded.items() for b, t in inner.items()}
    assert reference.keys() == sd.keys()
    loads_as(path, reference)
    loads_as(_nested_sd(sd), reference)


def _shared(levels: int) -> dict:
    """``levels`` dicts each holding the next under two keys: 2**levels dotted keys."""
    inner = {"w": torch.ones(1)}
    for _ in range(levels):
        inner = {"a": inner, "b": inner}
    return inner


@pytest.mark.parametrize("levels", [1, 64])
def test_one_dict_under_two_keys_is_refused(tmp_path, levels):
    path = str(tmp_path / "shared.pt")
    torch.save(_shared(levels), path)
    assert os.path.getsize(path) < 20_000
    obj = torch.load(path, weights_only=True)  # torch.load reads it: the pickle's memo shares the dict
    assert obj["a"] is obj["b"]
    error = refused(path, "holds one dict under both")
    assert path in str(error)
    refused(_shared(levels), "holds one dict under both")  # a state dict passed in memory too


def test_a_dict_inside_itself_is_refused(tmp_path):
    cyclic = {"w": torch.ones(1)}
    cyclic["again"] = cyclic
    path = str(tmp_path / "cycle.pt")
    torch.save(cyclic, path)
    obj = torch.load(path, weights_only=True)
    assert obj["again"] is obj
    refused(path, "inside itself")
    refused(cyclic, "inside itself")


def test_dicts_nested_deeper_than_the_interpreter_recurses_are_refused(tmp_path):
    depth = 100_000
    # {"k": {"k": ... {"k": None}}}, built by the pickle alone (pickle.dumps would recurse)
    pkl = b"\x80\x02" + b"}X\x01\x00\x00\x00k" * depth + b"N" + b"s" * depth + b"."
    path = str(tmp_path / "deep_dicts.pt")
    with_pickle(path, pkl)
    obj = torch.load(path, weights_only=True)  # the unpickler does not recurse
    for _ in range(depth):
        obj = obj["k"]
    assert obj is None
    refused(path, "nests dicts more than")


def test_a_dotted_key_given_twice_is_refused(tmp_path):
    sd = state_dict()
    twice = dict(sd)
    twice["0"] = {"weight": torch.zeros(4, 3)}  # also "0.weight"
    path = str(tmp_path / "twice.pt")
    torch.save(twice, path)
    obj = torch.load(path, weights_only=True)
    assert not torch.equal(obj["0.weight"], obj["0"]["weight"])  # which one would load is a guess
    refused(path, "names '0.weight' twice")
    refused(twice, "names '0.weight' twice")


# -- the legacy format ----------------------------------------------------------------


def _legacy_one(numel: int, data: bytes, size=None) -> bytes:
    storage = _Storage("0", torch.FloatStorage, numel)
    return legacy_bytes({"0.bias": _Tensor(storage, 0, size or (numel,), (1,))}, [(storage, data)])


@pytest.mark.parametrize("how", ["torch.save", "truncated", "count", "tensor past its storage", "huge", "deep tuples"])
def test_a_legacy_file_is_refused_unread_naming_the_fix(tmp_path, how):
    """The format before PyTorch 1.6 is refused, whatever it holds (torch.load
    reads the first, refuses the next three, allocates 16 GiB for the fifth and
    crashes on the last), and nothing of it is read: re-save it with torch.save."""
    path = str(tmp_path / "legacy.pt")
    data = torch.arange(4.0).numpy().tobytes()
    if how == "torch.save":
        torch.save(state_dict(), path, _use_new_zipfile_serialization=False)
    else:
        with open(path, "wb") as f:
            f.write({
                "truncated": lambda: _legacy_one(4, data)[:-3],
                "count": lambda: _legacy_one(4, data).replace((4).to_bytes(8, "little") + data, (3).to_bytes(8, "little") + data),
                "tensor past its storage": lambda: _legacy_one(4, data, size=(1000,)),
                "huge": lambda: _legacy_one(1 << 32, b"\0" * 16),
                "deep tuples": lambda: legacy_bytes(None, [], obj_pickle=DEEP_TUPLE_PICKLE),
            }[how]())
    error = refused(path, "is a legacy torch.save file .* re-save it with torch.save")
    assert path in str(error)


# -- paths that are not regular files --------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("name", ["ckpt.safetensors", "ckpt.bin", "in_a_folder"])
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path, name):
    folder = tmp_path / "folder"
    folder.mkdir()
    fifo = str(folder / ("model.safetensors" if name == "in_a_folder" else name))
    os.mkfifo(fifo)
    source = str(folder) if name == "in_a_folder" else fifo
    # A child process: opening a FIFO for reading blocks until someone writes to it.
    out = refusal_in_child(source, timeout=60)
    assert f"{fifo} is a FIFO, not a regular file" in out


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_a_device_is_refused():
    refused("/dev/zero", "/dev/zero is a character device, not a regular file")


# -- records read whole --------------------------------------------------------------


def test_a_small_record_inflating_to_a_big_one_loads_as_torch_load(tmp_path):
    """PyTorch's reader inflates the version record whole and reads its number:
    the file loads, as torch.load loads it."""
    buffer = io.BytesIO()
    torch.save(state_dict(), buffer)
    src = zipfile.ZipFile(buffer)
    path = str(tmp_path / "bomb.pt")
    # the version record: "3" and 16 MiB of spaces, deflated to a few KiB
    with zipfile.ZipFile(path, "w") as out:
        for name in src.namelist():
            data = src.read(name)
            if name.endswith("/version"):
                out.writestr(name, data.strip() + b" " * (16 << 20), zipfile.ZIP_DEFLATED)
            else:
                out.writestr(name, data)
    assert os.path.getsize(path) < 1 << 20
    loads_as(path, torch.load(path, weights_only=True))


# -- pickles that never finish --------------------------------------------------------


def _shared_tuples(levels: int) -> bytes:
    """{"w": 1, t: 1} where t = (t', t'), ``levels`` times over, through the memo."""
    pkl = b"\x80\x02}(X\x01\x00\x00\x00wK\x01" + b")q\x00"
    for i in range(levels):
        pkl += b"h" + bytes([i]) + b"\x86q" + bytes([i + 1])  # (top, memo[i]): the top is memo[i]
    return pkl + b"K\x01u."


def test_a_tuple_sharing_itself_that_hashes_forever_is_refused(tmp_path):
    path = str(tmp_path / "shared_tuples.pt")
    with_pickle(path, _shared_tuples(60))
    assert os.path.getsize(path) < 10_000
    # torch.load hashes the 2**60-element key: it would run for centuries
    with pytest.raises(subprocess.TimeoutExpired):
        child(f"import torch; torch.load({path!r}, weights_only=True)", timeout=8)
    with_pickle(path, _shared_tuples(10))  # 2**10: torch.load reads it
    child(f"import torch; assert len(torch.load({path!r}, weights_only=True)) == 2").check_returncode()
    with_pickle(path, _shared_tuples(60))
    out = refusal_in_child(path, timeout=120)
    assert path in out and "sharing tuples through its memo" in out


def _text(value: str) -> bytes:
    return b"X" + len(value).to_bytes(4, "little") + value.encode()


def _storage_of_shared_lists(levels: int) -> bytes:
    """{"w": a storage whose element count is l = [l', l'], ``levels`` times over}
    (``str(l)`` never returns)."""
    pkl = b"\x80\x02]q\x00"
    for i in range(levels):  # each list is left on the stack below the next
        pkl += b"](h" + bytes([i]) + b"h" + bytes([i]) + b"eq" + bytes([i + 1])
    pid = b"(" + _text("storage") + b"ctorch\nFloatStorage\n" + _text("0") + _text("cpu") + b"h" + bytes([levels]) + b"t"
    return pkl + b"}" + _text("w") + pid + b"Qs."


def test_an_error_about_a_value_that_shares_itself_is_bounded(tmp_path):
    path = str(tmp_path / "shared_lists.pt")
    with_pickle(path, _storage_of_shared_lists(60))
    # torch.load never returns either: it formats the list for its error message
    with pytest.raises(subprocess.TimeoutExpired):
        child(f"import torch; torch.load({path!r}, weights_only=True)", timeout=8)
    out = refusal_in_child(path, timeout=120)
    assert path in out and "tried to construct a storage from a sequence (list)" in out, out[:3000]


def test_a_tensor_named_by_a_tuple_is_refused(tmp_path):
    path = str(tmp_path / "tuple_key.pt")
    torch.save({("0", "weight"): torch.ones(4, 3)}, path)
    assert ("0", "weight") in torch.load(path, weights_only=True)
    refused(path, "names a tensor or dict by a tuple, not a string or an integer")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_an_index_that_is_a_fifo_is_refused(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    index = str(folder / "model.safetensors.index.json")
    os.mkfifo(index)
    out = refusal_in_child(str(folder), timeout=60)
    assert f"{index} is a FIFO, not a regular file" in out, out


def test_an_index_longer_than_the_limit_is_refused_unread(tmp_path, monkeypatch):
    from deferinit.materialize.checkpoint import index as index_module

    folder = tmp_path / "ckpt"
    folder.mkdir()
    torch.save(state_dict(), folder / "a.bin")
    weight_map = {k: "a.bin" for k in state_dict()}
    with open(folder / "pytorch_model.bin.index.json", "w") as f:
        json.dump({"weight_map": weight_map, "metadata": {"padding": "x" * 4096}}, f)
    loads_as(str(folder), state_dict())  # transformers reads it; so do we under the limit
    monkeypatch.setattr(index_module, "MAX_INDEX", 4096)
    refused(str(folder), "has more than 4096 bytes")


def test_many_records_load_as_torch_load(tmp_path):
    path = str(tmp_path / "many.pt")
    buffer = io.BytesIO()
    torch.save(state_dict(), buffer)
    src = zipfile.ZipFile(buffer)
    # 20,000 empty members more
    with zipfile.ZipFile(path, "w") as out:
        for name in src.namelist():
            out.writestr(name, src.read(name))
        prefix = src.namelist()[0].split("/")[0]
        for i in range(20_000):
            out.writestr(f"{prefix}/extra/{i}", b"")
    loads_as(path, torch.load(path, weights_only=True))


def test_a_refused_archive_leaves_torch_load_as_it_was(tmp_path):
    """torch.load's loader leaves its thread-local map_location set when it raises;
    load_checkpoint runs that loader and puts it back."""
    path = str(tmp_path / "bad.pt")
    with_pickle(path, _storage_of_shared_lists(2))  # refused by the loader, in persistent_load
    before = torch.serialization._serialization_tls.map_location
    with pytest.raises(CheckpointError):
        load_checkpoint(build(), path)
    assert torch.serialization._serialization_tls.map_location is before
