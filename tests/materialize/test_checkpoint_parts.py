"""Only the parts of a loaded tensor that are read later are read (issue 18 item 5),
in one process: the operators DTensor's scatter and FSDP2 record on a 2-D mesh
(a copy of a tensor-parallel piece into padded memory, a ``contiguous()`` of
an uneven piece, FSDP's rows of it), replayed here by hand on a deferred
module.  Values against the same operators on eager tensors; bytes read with
``rchar`` of /proc/self/io."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from deferinit import deferred_init
from deferinit.materialize import load_checkpoint, materialize_tensor
from deferinit.materialize.checkpoint import dcp as dcp_source

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts bytes read with /proc/self/io")


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1023, 64))


def _rank1_piece(w):
    """What parallelize_module records on rank 1 of 2 for Shard(0): its rows, in
    padded memory (DTensor pads the uneven piece), and the view it keeps."""
    piece = w.split(512)[1]  # 511 rows
    out = piece.new_empty(512, 64)
    out.narrow(0, 0, 511).copy_(piece)
    out.narrow(0, 511, 1).zero_()
    return out.narrow(0, 0, 511)


def _measured(fn):
    probe = rchar()
    probe = rchar() - probe
    before = rchar()
    fn()
    return rchar() - before - probe


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(7)
    weights = {"w": torch.randn(1023, 64)}
    path = tmp_path / "w.safetensors"
    save_file(weights, path)
    return path, weights["w"]


def test_a_copy_into_padded_memory_reads_only_the_rows_kept(checkpoint):
    path, w = checkpoint
    torch.manual_seed(0)
    m = deferred_init(Holder)
    load_checkpoint(m, path)
    with torch.no_grad():
        local = _rank1_piece(m.w)
        shard = local.new_zeros(256, 64)
        shard.copy_(local[:256])  # FSDP2's rows of the piece on dp rank 0
        expected = _rank1_piece(w)[:256]
    read = _measured(lambda: materialize_tensor(shard))
    assert torch.equal(shard, expected)
    assert read == 256 * 64 * 4


def test_a_contiguous_copy_of_a_column_piece_reads_only_the_rows_kept(checkpoint):
    """Rowwise pieces are column blocks; FSDP2 takes contiguous() of them."""
    path, w = checkpoint
    torch.manual_seed(0)
    m = deferred_init(Holder)
    load_checkpoint(m, path)

    def cut(t):
        piece = t.split(32, dim=1)[1]  # columns 32..63
        out = piece.new_empty(1023, 33)
        out.narrow(1, 0, 32).copy_(piece)
        out.narrow(1, 32, 1).zero_()
        return out.narrow(1, 0, 32).contiguous()[:100].clone()

    with torch.no_grad():
        shard = cut(m.w)
        expected = cut(w)
    read = _measured(lambda: materialize_tensor(shard))
    assert torch.equal(shard, expected)
    assert read == 100 * 32 * 4


def save_in_chunks(w: torch.Tensor, path, rows) -> str:
    """A distributed checkpoint holding ``w`` as chunks of ``rows`` rows (as ranks
    of a job would have saved it), written in one process: each piece saved by
    dcp.save, then the metadata made to say they are chunks of one tensor."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata

    pieces = w.split(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({f"piece{i}": p.clone() for i, p in enumerate(pieces)}, checkpoint_id=str(path), no_dist=True)
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    chunks, storage, at = [], {}, 0
    for i, p in enumerate(pieces):
        offsets = torch.Size([at, 0])
        chunks.append(ChunkStorageMetadata(offsets, p.shape))
        storage[MetadataIndex("w", offsets)] = next(v for k, v in meta.storage_data.items() if k.fqn == f"piece{i}")
        at += p.shape[0]
    properties = meta.state_dict_metadata["piece0"].properties
    meta.state_dict_metadata = {"w": TensorStorageMetadata(properties, w.shape, chunks)}
    meta.storage_data = storage
    meta.planner_data = {"w": ("w",)}
    with open(os.path.join(str(path), ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    reference = {"w": torch.empty_like(w)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(reference, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(reference["w"], w)  # PyTorch reads it as that tensor
    return str(path)


def test_a_distributed_checkpoint_part_spanning_chunks(tmp_path):
    """A block meeting several chunks reads from each only the elements inside it."""
    w = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)
    path = save_in_chunks(w, tmp_path / "ckpt", [10, 10, 20])
    entry = dcp_source.open_dcp(path)["w"]
    entry.source.need([entry])  # the chunks' layouts, read as load_checkpoint reads them
    out = torch.empty(15, 4)
    read = _measured(lambda: entry.box((8, 1), (15, 4)).read_parts(out))
    assert torch.equal(out, w[8:23, 1:5])
    assert read == 15 * 4 * 4
    flat = torch.empty(13)  # elements 5..17: across rows and a chunk boundary (not a block)
    entry.read(flat, 55, (13,), (1,))
    assert torch.equal(flat, w.reshape(-1)[55:68])
