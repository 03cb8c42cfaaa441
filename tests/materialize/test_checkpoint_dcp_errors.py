"""A distributed checkpoint directory is untrusted input (issue 18 items 1 and 4).

Every corrupt or hostile directory raises ``CheckpointError`` at
``load_checkpoint`` (naming the checkpoint and what is wrong) and changes
nothing; a ``.metadata`` file is never run as a program; a directory changed
after ``load_checkpoint`` raises ``CheckpointReadError`` at materialization,
before anything is swapped in.  A mutation fuzzer (fixed profile) requires,
for every mutant, either ``dcp.load``'s values or a ``CheckpointError``.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import shutil
import warnings
import zipfile

import pytest
import torch
import torch.nn as nn

from deferinit import CheckpointError, CheckpointNotFoundError, CheckpointReadError, deferred_init, graph_of, is_deferred
from deferinit.materialize import load_checkpoint, materialize_module

dcp = pytest.importorskip("torch.distributed.checkpoint")


def build():
    return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))


def save(state, path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return str(path)


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(9)
    sd = build().state_dict()
    return save(sd, tmp_path / "ckpt"), sd


def metadata(path):
    return dcp.FileSystemReader(path).read_metadata()  # our own file: trusted here


def write_metadata(path, meta) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def storage_of(meta, key):
    return next(info for index, info in meta.storage_data.items() if index.fqn == key)


def refused(path, match):
    """load_checkpoint raises CheckpointError matching ``match``; the module is unchanged."""
    torch.manual_seed(0)
    m = deferred_init(build)
    before = str(graph_of(m))
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(m, path)
    assert str(graph_of(m)) == before and is_deferred(m)
    torch.manual_seed(0)
    real = build()
    state = {k: v.clone() for k, v in real.state_dict().items()}
    with pytest.raises(CheckpointError):
        load_checkpoint(real, path)
    assert all(torch.equal(v, state[k]) for k, v in real.state_dict().items())
    return str(info.value)


def test_metadata_is_never_run(ckpt, tmp_path):
    path, _ = ckpt
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    meta = metadata(path)
    meta.planner_data = Evil()  # where loading needs nothing: refused all the same
    write_metadata(path, meta)
    refused(path, "uses posix.system, which load_checkpoint does not allow")
    assert not marker.exists()
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump({"state_dict_metadata": {}}, f)
    refused(path, "holds a dict, not a distributed checkpoint's Metadata")


@pytest.mark.parametrize(
    "name, match",
    [
        ("../outside.distcp", "not a file name inside the checkpoint"),
        ("/etc/passwd", "not a file name inside the checkpoint"),
        ("sub/../__0_0.distcp", "not a file name inside the checkpoint"),
        ("missing.distcp", "cannot read .*missing.distcp"),
        ("link.distcp", "a symbolic link to .*outside.distcp, outside"),
        (7, "not a file name inside the checkpoint"),
    ],
)
def test_chunk_files_stay_inside_the_directory(ckpt, tmp_path, name, match):
    path, _ = ckpt
    shutil.copy(os.path.join(path, "__0_0.distcp"), tmp_path / "outside.distcp")
    os.symlink(tmp_path / "outside.distcp", os.path.join(path, "link.distcp"))
    meta = metadata(path)
    storage_of(meta, "0.weight").relative_path = name
    write_metadata(path, meta)
    refused(path, match)


def test_a_missing_chunk_file_is_also_a_file_not_found_error(ckpt):
    """As for a file an index names: code that catches FileNotFoundError
    (written for torch.load, dcp.load) catches it too."""
    path, _ = ckpt
    meta = metadata(path)
    storage_of(meta, "0.weight").relative_path = "missing.distcp"
    write_metadata(path, meta)
    m = deferred_init(build)
    before = str(graph_of(m))
    with pytest.raises(CheckpointNotFoundError, match="'0.weight' in missing.distcp") as info:
        load_checkpoint(m, path)
    assert isinstance(info.value, FileNotFoundError) and info.value.filename == os.path.join(path, "missing.distcp")
    assert str(graph_of(m)) == before and is_deferred(m)


def test_chunks_inside_their_files_and_tensors(ckpt):
    path, _ = ckpt
    size = os.path.getsize(os.path.join(path, "__0_0.distcp"))
    cases = [
        (lambda m: setattr(storage_of(m, "0.bias"), "offset", size), "puts it at bytes"),
        (lambda m: setattr(storage_of(m, "0.bias"), "length", -1), "length -1"),
        (lambda m: setattr(storage_of(m, "0.bias"), "offset", "12"), "offset '12'"),
        (lambda m: setattr(m.state_dict_metadata["0.bias"].chunks[0], "sizes", torch.Size([17])), "outside the tensor's"),
        (lambda m: m.state_dict_metadata["0.bias"].chunks.append(m.state_dict_metadata["0.bias"].chunks[0]), "hold 32 elements of 16"),
        (lambda m: setattr(m.state_dict_metadata["0.bias"].properties, "dtype", torch.float64), "the metadata says"),
        (lambda m: setattr(m.state_dict_metadata["0.bias"], "size", torch.Size([8, 2])), "for a tensor of \\[8, 2\\]"),
        (lambda m: setattr(storage_of(m, "0.bias"), "transform_descriptors", ["zstd/1"]), "transforms"),
        (lambda m: m.storage_data.update({i: storage_of(m, "0.weight") for i in m.storage_data if i.fqn == "0.bias"}),
         "holds \\[16, 8\\]"),
        (lambda m: m.storage_data.clear(), "has no record for"),
        (lambda m: setattr(m, "state_dict_metadata", []), "not a dict"),
    ]
    original = open(os.path.join(path, ".metadata"), "rb").read()
    for mutate, match in cases:
        meta = metadata(path)
        mutate(meta)
        write_metadata(path, meta)
        refused(path, match)
        open(os.path.join(path, ".metadata"), "wb").write(original)


def _dcp_load(path):
    torch.manual_seed(0)
    m = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(m.state_dict(), checkpoint_id=path, no_dist=True)
    return m


def test_a_size_written_as_a_list_is_refused_as_dcp_load_refuses_it(ckpt):
    """dcp.load compares a tensor's ``size`` with the module's ``torch.Size``: a
    list never equals one, a tuple does (found by the fuzzer's long profile)."""
    path, _ = ckpt
    meta = metadata(path)
    meta.state_dict_metadata["0.bias"].size = list(meta.state_dict_metadata["0.bias"].size)
    write_metadata(path, meta)
    with pytest.raises(BaseException, match="Size mismatch"):  # dcp's CheckpointException is a BaseException
        _dcp_load(path)
    refused(path, r"state_dict_metadata\['0.bias'\]\.size is the list \[16\], not a torch.Size")
    meta.state_dict_metadata["0.bias"].size = tuple(meta.state_dict_metadata["0.bias"].size)
    write_metadata(path, meta)
    reference = _dcp_load(path).state_dict()
    m = deferred_init(build)
    load_checkpoint(m, path)
    materialize_module(m)
    assert all(torch.equal(v, reference[k]) for k, v in m.state_dict().items())


def test_overlapping_chunks(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    path = save({"w": torch.randn(4, 4)}, tmp_path / "ckpt")
    meta = metadata(path)
    item = meta.state_dict_metadata["w"]
    info = storage_of(meta, "w")
    # Two 2 x 4 chunks at rows 0 and 1: as many elements as the tensor, overlapping on row 1.
    item.chunks = [ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([n, 4])) for r, n in ((0, 2), (1, 2))]
    meta.storage_data = {MetadataIndex("w", c.offsets): info for c in item.chunks}
    write_metadata(path, meta)
    m = nn.Module()
    m.w = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(CheckpointError, match="overlap"):
        load_checkpoint(m, path)


def _rewrite_chunk(path, key, change):
    """Apply ``change(zip bytes) -> zip bytes`` to the torch.save archive of ``key``'s chunk."""
    meta = metadata(path)
    info = storage_of(meta, key)
    file = os.path.join(path, info.relative_path)
    with open(file, "rb") as f:
        data = f.read()
    chunk = change(data[info.offset : info.offset + info.length])
    with open(file, "wb") as f:
        f.write(data[: info.offset] + chunk + data[info.offset + info.length :])
    # Later chunks move; the metadata follows.
    shift = len(chunk) - info.length
    for other in meta.storage_data.values():
        if other.relative_path == info.relative_path and other.offset > info.offset:
            other.offset += shift
    info.length = len(chunk)
    write_metadata(path, meta)


def _rezip(records):
    def change(raw):
        old = zipfile.ZipFile(io.BytesIO(raw))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as new:
            for item in old.infolist():
                body = old.read(item.filename)
                name, body, kind = records(item.filename, body)
                if name is not None:
                    new.writestr(name, body, compress_type=kind)
        return out.getvalue()

    return change


@pytest.mark.parametrize(
    "records, match",
    [
        (lambda n, b: (n, b[:-4] if "/data/" in n else b, zipfile.ZIP_STORED), "record 'data/0' has 60 bytes, its pickle says 64"),
        # torch 2.15 refuses a longer record too ("record size does not match expected size").
        (lambda n, b: (n, b + bytes(4) if "/data/" in n else b, zipfile.ZIP_STORED), "record 'data/0' has 68 bytes, its pickle says 64"),
        (lambda n, b: (None if "/data/" in n else n, b, zipfile.ZIP_STORED), "failed locating file data/0"),
        (lambda n, b: (n, pickle.dumps({"x": 1}, protocol=2) if n.endswith("data.pkl") else b, zipfile.ZIP_STORED), "not one tensor"),
    ],
)
def test_chunk_archives_are_checked(ckpt, records, match):
    path, _ = ckpt
    _rewrite_chunk(path, "0.bias", _rezip(records))
    refused(path, match)


@pytest.mark.parametrize(
    "records",
    [
        lambda n, b: (n, b, zipfile.ZIP_DEFLATED),
        lambda n, b: (n, b"big" if n.endswith("byteorder") else b[::-1] if "/data/" in n else b, zipfile.ZIP_STORED),
    ],
    ids=["deflated", "big-endian"],
)
def test_chunks_torch_load_reads_load_as_dcp_load(ckpt, records):
    """A chunk is read as dcp.load reads it (torch.load of its stretch): deflated
    records inflated, a big-endian one's elements swapped (a 1-D float chunk
    reversed whole is each element's bytes reversed, the elements reversed)."""
    path, sd = ckpt
    _rewrite_chunk(path, "0.bias", _rezip(records))
    expected = _reference(path)
    assert expected is not None
    for real in (False, True):
        torch.manual_seed(0)
        m = build() if real else deferred_init(build)
        load_checkpoint(m, path)
        if not real:
            materialize_module(m)
        assert all(torch.equal(v, expected[k]) for k, v in m.state_dict().items())


def test_a_rezipped_chunk_is_read_where_its_headers_say(ckpt):
    """A chunk re-zipped by a zip tool (same records, other positions) loads as dcp.load loads it."""
    path, sd = ckpt
    _rewrite_chunk(path, "0.weight", _rezip(lambda n, b: (n, b, zipfile.ZIP_STORED)))
    torch.manual_seed(0)
    m = deferred_init(build)
    load_checkpoint(m, path)
    materialize_module(m)
    assert torch.equal(m[0].weight.detach(), sd["0.weight"])


def test_garbage_chunk(ckpt):
    path, _ = ckpt
    _rewrite_chunk(path, "1.bias", lambda raw: os.urandom(len(raw)))
    refused(path, "is not a torch.save archive torch.load reads: torch.load cannot open it")


def _counting_layouts(monkeypatch) -> list:
    """The chunks whose layout load_checkpoint reads from now on (their positions)."""
    from deferinit.materialize.checkpoint import dcp as source

    seen, chunk_layout = [], source.chunk_layout

    def counted(f, start, length, what):
        seen.append(start)
        return chunk_layout(f, start, length, what)

    monkeypatch.setattr(source, "chunk_layout", counted)
    return seen


@pytest.mark.parametrize("part", ["prefix", "strict=False"])
def test_a_load_of_part_of_the_model_reads_only_its_chunks(ckpt, monkeypatch, part):
    """Loading the first Linear only opens its two chunks, as dcp.load of its
    keys reads only theirs: a damaged chunk of the second Linear changes
    nothing (dcp.load of those keys loads it too); the damaged chunk is
    refused when it is needed."""
    path, sd = ckpt
    _rewrite_chunk(path, "1.bias", lambda raw: os.urandom(len(raw)))
    wanted = {k: storage_of(metadata(path), k).offset for k in ("0.weight", "0.bias")}
    reference = {k: torch.zeros_like(sd[k]) for k in wanted}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(reference, checkpoint_id=path, no_dist=True)
    seen = _counting_layouts(monkeypatch)
    for real in (False, True):
        torch.manual_seed(0)
        if part == "prefix":
            m = nn.Linear(8, 16) if real else deferred_init(nn.Linear, 8, 16)
            load_checkpoint(m, path, prefix="0.")
            values = {"0.weight": m.weight, "0.bias": m.bias}
        else:
            m = nn.Sequential(nn.Linear(8, 16)) if real else deferred_init(nn.Sequential, nn.Linear(8, 16))
            load_checkpoint(m, path, strict=False)
            values = {"0.weight": m[0].weight, "0.bias": m[0].bias}
        if not real:
            materialize_module(m)
        assert all(torch.equal(v.detach(), reference[k]) for k, v in values.items())
        assert sorted(seen) == sorted(wanted.values()), (seen, wanted)
        seen.clear()
    torch.manual_seed(0)
    m = deferred_init(nn.Linear, 16, 4)
    with pytest.raises(CheckpointError, match="'1.bias' .* is not a torch.save archive torch.load reads"):
        load_checkpoint(m, path, prefix="1.")
    assert is_deferred(m)


def test_a_chunk_first_read_while_materializing_is_checked_then(ckpt):
    """A chunk no load_checkpoint needed (the source read directly) is read and
    checked when a read first meets it: refused as a file cut short is."""
    from deferinit.materialize.checkpoint.dcp import open_dcp

    path, sd = ckpt
    _rewrite_chunk(path, "1.bias", lambda raw: os.urandom(len(raw)))
    entries = open_dcp(path)  # the metadata only: every field checked
    out = torch.empty(16)
    entries["0.bias"].read_parts(out)
    assert torch.equal(out, sd["0.bias"])
    with pytest.raises(CheckpointReadError, match="is not a torch.save archive torch.load reads.*Nothing was changed"):
        entries["1.bias"].read_parts(torch.empty(4))


def test_per_rank_metadata_only(ckpt):
    path, _ = ckpt
    os.rename(os.path.join(path, ".metadata"), os.path.join(path, "__0.metadata"))
    refused(path, "per-rank metadata")


def test_changed_after_load_checkpoint(ckpt):
    path, sd = ckpt
    torch.manual_seed(0)
    m = deferred_init(build)
    load_checkpoint(m, path)
    # The same content rewritten (a new inode): still fine.
    data = open(os.path.join(path, "__0_0.distcp"), "rb").read()
    os.remove(os.path.join(path, "__0_0.distcp"))
    open(os.path.join(path, "__0_0.distcp"), "wb").write(data)
    torch.manual_seed(0)
    m2 = deferred_init(build)
    load_checkpoint(m2, path)
    # Another checkpoint saved over it: refused at materialization, nothing swapped in.
    shutil.rmtree(path)
    torch.manual_seed(1)
    save({k: v[..., :1].expand_as(v).clone() if v.dim() else v for k, v in build().state_dict().items()}, path)
    generator = torch.get_rng_state()
    with pytest.raises(CheckpointReadError, match="changed since load_checkpoint"):
        materialize_module(m2)
    assert is_deferred(m2) and torch.equal(torch.get_rng_state(), generator)
    shutil.rmtree(path)
    with pytest.raises(CheckpointReadError, match="No such file"):
        materialize_module(m)
    assert is_deferred(m)


# -- mutation fuzzer ------------------------------------------------------------------


def _reference(path):
    """dcp.load's values for the directory, or None when dcp.load refuses it."""
    torch.manual_seed(0)
    model = build()
    state = model.state_dict()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=path, no_dist=True)
    except (Exception, dcp.api.CheckpointException):  # noqa: BLE001 - any refusal (that one is a BaseException)
        return None
    return {k: v.clone() for k, v in state.items()}


def _mutants(path, rng, count):
    files = sorted(n for n in os.listdir(path))
    for i in range(count):
        name = rng.choice(files)
        data = bytearray(open(os.path.join(path, name), "rb").read())
        kind = rng.choice(["flip", "truncate", "zero"])
        if kind == "flip":
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind == "truncate":
            data = data[: rng.randrange(len(data))]
        else:
            at = rng.randrange(len(data))
            data[at : at + rng.randint(1, 16)] = bytes(min(len(data) - at, 16))
        yield i, name, bytes(data)


@pytest.mark.parametrize("seed", [0, 1])
def test_mutants_load_dcp_values_or_raise_checkpoint_error(ckpt, tmp_path, seed):
    """Each mutant directory: the values dcp.load gets, or CheckpointError with
    the module unchanged; never another exception.  Mutants of ``.metadata``
    are given to dcp.load only when they still unpickle as PyTorch's Metadata
    with our reader (dcp.load would run whatever a mutant names)."""
    path, _ = ckpt
    rng = random.Random(seed)
    work = str(tmp_path / "mutant")
    outcomes = {"values": 0, "refused": 0}
    for i, name, data in _mutants(path, rng, 60):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(path, work)
        with open(os.path.join(work, name), "wb") as f:
            f.write(data)
        torch.manual_seed(0)
        m = deferred_init(build)
        before = str(graph_of(m))
        try:
            load_checkpoint(m, work)
        except CheckpointError:
            assert str(graph_of(m)) == before, f"mutant {i} ({name}): refused after recording"
            outcomes["refused"] += 1
            continue
        try:
            materialize_module(m)
        except CheckpointReadError:
            assert is_deferred(m), f"mutant {i} ({name}): refused after swapping in"
            outcomes["refused"] += 1
            continue
        expected = _reference(work)
        assert expected is not None, f"mutant {i} ({name}) loads here, dcp.load refuses it"
        for k, v in m.state_dict().items():
            assert torch.equal(v, expected[k]), f"mutant {i} ({name}): {k} differs from dcp.load's"
        outcomes["values"] += 1
    assert outcomes["refused"] and outcomes["values"]


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_file_of_the_checkpoint_given_alone_names_its_directory(ckpt, name):
    path, _ = ckpt
    refused(os.path.join(path, name), f"is a file of the distributed checkpoint {path}, .* pass its directory")
