"""Large tensors are read from a checkpoint by several threads at once
(materialize/checkpoint/parallel.py): into their final storage, with the values
eager ``load_state_dict`` gives, every piece's error raised in the caller, and
no thread writing once the call has returned or been interrupted (a helper
still to start ends without touching anything).
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


def build():
    return nn.Sequential(nn.Linear(1024, 4096), nn.Linear(4096, 16))  # a 16 MiB weight (four pieces)


def _pread_threads(monkeypatch, wait_for_both=False) -> list:
    """The threads each ``os.preadv`` of at least a piece ran in; ``wait_for_both``:
    a read by the main thread waits (up to 5 s) until a helper has read, and a
    helper's until the main thread has (so that a loaded machine, where either
    could take every piece before the other runs, does not decide)."""
    seen = []
    real = os.preadv
    read_by = {"main": threading.Event(), "helper": threading.Event()}

    def spy(fd, buffers, position, *rest):
        if sum(len(b) for b in buffers) >= parallel.PIECE_BYTES:
            seen.append((threading.get_ident(), threading.current_thread().name, torch.get_num_threads()))
            mine, other = ("main", "helper") if threading.current_thread() is threading.main_thread() else ("helper", "main")
            read_by[mine].set()
            if wait_for_both:
                read_by[other].wait(5)
        return real(fd, buffers, position, *rest)

    monkeypatch.setattr(os, "preadv", spy)
    return seen


def _helpers_end() -> bool:
    """No reading helper is left within 5 s (other tests' threads may come and go meanwhile)."""
    deadline = time.monotonic() + 5
    while any(t.name == "deferinit-pread" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(t.name == "deferinit-pread" for t in threading.enumerate())


def test_a_large_tensor_is_read_by_several_threads_with_eager_values(tmp_path, monkeypatch, two_threads):
    torch.manual_seed(0)
    path = tmp_path / "model.safetensors"
    save_file(build().state_dict(), str(path))
    eager = build()
    eager.load_state_dict(load_file(str(path)))
    seen = _pread_threads(monkeypatch, wait_for_both=True)

    m = deferred_init(build)
    load_checkpoint(m, path)
    materialize_module(m)

    assert len({ident for ident, _, _ in seen}) == 2, f"the 16 MiB weight is read by two threads: {seen[:4]}"
    for (name, a), b in zip(m.state_dict().items(), eager.state_dict().values()):
        assert torch.equal(a, b), name
    assert _helpers_end(), "the helpers end"


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
    assert {ident for ident, _, _ in seen} == {threading.get_ident()}


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


def test_an_interrupt_waits_for_the_pieces_being_read_and_nothing_is_written_after(two_threads):
    buffer = memoryview(bytearray(8 * parallel.PIECE_BYTES))
    helper_reading = threading.Event()
    finished = []

    def read(position, piece):
        if threading.current_thread() is threading.main_thread():
            assert helper_reading.wait(10)
            raise KeyboardInterrupt
        helper_reading.set()
        time.sleep(0.2)
        piece[:] = b"\1" * len(piece)
        finished.append(position)

    with pytest.raises(KeyboardInterrupt):
        parallel.in_pieces(read, 0, buffer)
    assert len(finished) == 1, "the helper's piece was done before the interrupt was let through, and no other taken"
    snapshot = bytes(buffer)
    time.sleep(0.3)
    assert bytes(buffer) == snapshot, "nothing is written into the buffer after the call"
    assert _helpers_end(), "the helper ends on its own"


def test_a_helper_that_is_not_scheduled_is_not_waited_for(two_threads, monkeypatch):
    """On a busy machine a helper may start late: the caller reads every piece itself
    and returns; the helper, when it runs, finds nothing left and writes nothing."""
    release = threading.Event()
    real_start = threading.Thread.start

    def late_start(self):
        target = self._target

        def late(*args, **kwargs):
            release.wait(10)
            target(*args, **kwargs)

        self._target = late
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", late_start)
    readers = []

    def read(position, piece):
        readers.append(threading.current_thread())
        piece[:] = b"\2" * len(piece)

    buffer = memoryview(bytearray(4 * parallel.PIECE_BYTES))
    parallel.in_pieces(read, 0, buffer)
    release.set()
    assert set(readers) == {threading.current_thread()} and len(readers) == 4
    assert bytes(buffer) == b"\2" * len(buffer)
