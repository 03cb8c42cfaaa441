"""Large tensors are read from a checkpoint by several threads at once
(materialize/checkpoint/parallel.py): into their final storage, with the values
eager ``load_state_dict`` gives, every piece's error raised in the caller, and
no thread still writing (or alive) once the call has returned or been interrupted.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from deferinit import CheckpointReadError, deferred_init
from deferinit.materialize import load_checkpoint, materialize_module
from deferinit.materialize.checkpoint import parallel


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def build():
    return nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 16))  # an 8 MiB weight


def _pread_threads(monkeypatch) -> list:
    """The threads each ``os.preadv`` of at least a piece ran in."""
    seen = []
    real = os.preadv

    def spy(fd, buffers, position, *rest):
        if sum(len(b) for b in buffers) >= parallel.PIECE_BYTES:
            seen.append(threading.get_ident())
        return real(fd, buffers, position, *rest)

    monkeypatch.setattr(os, "preadv", spy)
    return seen


def test_a_large_tensor_is_read_by_several_threads_with_eager_values(tmp_path, monkeypatch, two_threads):
    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    save_file(build().state_dict(), str(path))
    eager = build()
    eager.load_state_dict(load_file(str(path)))
    threads_before = threading.active_count()
    seen = _pread_threads(monkeypatch)

    m = deferred_init(build)
    load_checkpoint(m, path)
    materialize_module(m)

    assert len(set(seen)) == 2, "the 8 MiB weight is read in two pieces, by two threads"
    for (name, a), b in zip(m.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), name
    assert threading.active_count() == threads_before


def test_one_thread_when_torch_is_told_to_use_one(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = tmp_path / "model.safetensors"
        save_file(build().state_dict(), str(path))
        seen = _pread_threads(monkeypatch)
        m = deferred_init(build)
        load_checkpoint(m, path)
        materialize_module(m)
    finally:
        torch.set_num_threads(before)
    assert set(seen) == {threading.get_ident()}


def test_the_error_of_a_piece_read_by_another_thread_is_raised_by_the_caller(two_threads):
    buffer = memoryview(bytearray(4 * parallel.PIECE_BYTES))
    done = []

    def read(position, piece):
        if position > 0:
            raise CheckpointReadError(f"cut short at {position}")
        time.sleep(0.05)
        done.append(position)

    with pytest.raises(CheckpointReadError, match="cut short at"):
        parallel.in_pieces(read, 0, buffer)
    assert done == [0], "the caller's own piece was read before the error was raised"


def test_an_interrupt_waits_for_every_piece_and_leaves_no_thread(two_threads):
    buffer = memoryview(bytearray(4 * parallel.PIECE_BYTES))
    finished = []

    def read(position, piece):
        if position == 0:
            raise KeyboardInterrupt
        time.sleep(0.2)
        piece[:] = b"\1" * len(piece)
        finished.append(position)

    threads_before = threading.active_count()
    with pytest.raises(KeyboardInterrupt):
        parallel.in_pieces(read, 0, buffer)
    assert finished, "the other piece was done before the interrupt was let through"
    assert bytes(buffer[-1:]) == b"\1"
    assert threading.active_count() == threads_before
