"""load_checkpoint of distributed checkpoints on gloo ranks (issue 18 item 4).

A checkpoint saved by ``dcp.save`` from an eager model sharded on N ranks
is loaded on M ranks into a deferred model, before or after FSDP2, tensor
parallel or both (2-D); each rank's tensors equal eager's (the same model
sharded the same way, filled by ``dcp.load``), no random kernel runs, and
each rank reads the bytes of the pieces it keeps and the checkpoint's
headers, nothing more (rank bodies in tests/dcp_workers.py).
"""

import os

import pytest
import torch

import dcp_workers as workers
from multiproc import run_ranks

pytestmark = [
    pytest.mark.skipif(
        not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
        reason="needs torch.distributed with gloo",
    ),
    pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts bytes read with /proc/self/io"),
]

# Per chunk, what reading its archive's headers may cost: PyTorch's reader
# reads an archive's last 4 KiB to find its end record (and the zip
# directory in it), then local headers, pickle, version and byte order records.
CHUNK_HEADER = 5120
# Reading /proc/self/io itself, and Python's own small reads.
SLACK = 4096


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(model, layout, ranks)``: the directory of an eager model (seed 7)
    sharded by ``layout`` on ``ranks`` ranks and saved with dcp.save (once each)."""
    done = {}

    def get(model, layout, ranks):
        key = (model, layout, ranks)
        if key not in done:
            path = str(tmp_path_factory.mktemp("dcp") / f"{model}-{layout}-{ranks}")
            run_ranks(workers.case_save, ranks, model, layout, path, timeout=300)
            done[key] = path
        return done[key]

    return get


def check_reads(path, results):
    from deferinit.materialize.checkpoint.dcp_metadata import METADATA, read_metadata, tensors

    chunks = sum(len(t.chunks) for t in tensors(read_metadata(path), path).values())
    headers = os.path.getsize(os.path.join(path, METADATA)) + CHUNK_HEADER * chunks
    for r in results:
        assert r["random"] == [], r
        assert r["headers"] <= headers + SLACK, (r, headers)
        # The bytes of its own pieces, once.
        assert r["own"] <= r["read"] <= r["own"] + SLACK, r


def chunk_count(path) -> int:
    from deferinit.materialize.checkpoint.dcp_metadata import read_metadata, tensors

    return sum(len(t.chunks) for t in tensors(read_metadata(path), path).values())


@pytest.mark.parametrize("order", ["before", "after"])
def test_fsdp2_saved_on_two_loaded_on_two(saved, order):
    path = saved("wide", "fsdp", 2)
    results = run_ranks(workers.case_load, 2, "wide", "fsdp", path, order, timeout=300)
    check_reads(path, results)
    read = [set(r["layouts"]) for r in results]
    assert all(len(r["layouts"]) == len(s) for r, s in zip(results, read)), "a chunk's layout read twice"
    if order == "after":
        # Sharded as it was saved, each rank's blocks are its own chunks: it
        # reads their layouts and never opens the other rank's (as dcp.load,
        # whose plan reads the chunks the rank's state dict meets).
        assert not read[0] & read[1] and len(read[0] | read[1]) == chunk_count(path), read
    else:
        # Loaded whole before sharding: the whole tensors' chunks, as dcp.load
        # into the unsharded model reads them (docs/guide.md, distributed checkpoints).
        assert all(len(s) == chunk_count(path) for s in read), read


def test_fsdp2_saved_on_two_loaded_on_one_unsharded(saved):
    path = saved("wide", "fsdp", 2)
    check_reads(path, run_ranks(workers.case_load, 1, "wide", "none", path, "before", timeout=300))


@pytest.mark.parametrize("order", ["before", "after"])
def test_tensor_parallel_uneven_rows_saved_on_two_loaded_on_two(saved, order):
    """Linear(64, 1023) colwise: rank 1's piece is padded; no random kernel runs on it."""
    path = saved("mlp", "tp", 2)
    check_reads(path, run_ranks(workers.case_load, 2, "mlp", "tp", path, order, timeout=300))


def test_fsdp2_checkpoint_into_tensor_parallel(saved):
    path = saved("mlp", "fsdp", 2)
    check_reads(path, run_ranks(workers.case_load, 2, "mlp", "tp", path, "after", timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("order", ["before", "after"])
def test_fsdp2_saved_on_two_loaded_on_four(saved, order):
    path = saved("wide", "fsdp", 2)
    check_reads(path, run_ranks(workers.case_load, 4, "wide", "fsdp", path, order, timeout=400))


@pytest.mark.slow
@pytest.mark.parametrize("order", ["before", "after"])
def test_2d_saved_on_four_loaded_on_four(saved, order):
    """Tensor parallel inside FSDP2 on a 2 x 2 mesh (_StridedShard placements)."""
    path = saved("mlp", "2d", 4)
    check_reads(path, run_ranks(workers.case_load, 4, "mlp", "2d", path, order, timeout=400))


@pytest.mark.slow
def test_2d_saved_on_four_loaded_on_two_fsdp2(saved):
    path = saved("mlp", "2d", 4)
    check_reads(path, run_ranks(workers.case_load, 2, "mlp", "fsdp", path, "after", timeout=400))
