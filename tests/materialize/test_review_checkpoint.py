"""Review attack on checkpoint loading (issue 27): parallel piece reads, the file
changing under the load, read errors and interrupts inside piece reads, and the
values it gives in the cases a hostile user tries, always compared with eager
``load_state_dict`` of ``safetensors.torch.load_file`` / ``torch.load``."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from deferinit import CheckpointReadError, deferred_init, is_deferred
from deferinit.materialize import load_checkpoint, materialize_module
from deferinit.materialize.checkpoint import files, parallel
from test_interrupts import _AtLine  # its trace function, given the functions watched here

PARALLEL = os.path.abspath(parallel.__file__)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _helpers_end(timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(t.name == "deferinit-pread" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not any(t.name == "deferinit-pread" for t in threading.enumerate())


def _same(eager: nn.Module, m: nn.Module) -> list:
    """The names whose dtype, shape, strides or bytes differ."""
    wrong = []
    for (name, a), b in zip(eager.state_dict().items(), m.state_dict().values()):
        if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
            wrong.append(name)
        elif not torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            wrong.append(name)
    return wrong


# -- interrupts inside the parallel read ------------------------------------------------


def test_an_interrupt_at_any_line_of_a_parallel_read_neither_hangs_nor_writes_after(two_threads):
    """A Ctrl-C between two lines of in_pieces (the one-shot trace of
    tests/test_interrupts.py, at every line the caller runs in turn): the call
    raises within a few seconds, and no helper writes into the buffer once it has.
    It hung when the interrupt fell between the caller counting its own piece
    busy and counting it done, and helpers already started read on when it fell
    among their starts."""
    buffer = memoryview(bytearray(6 * parallel.PIECE_BYTES))

    def read(position, piece):
        time.sleep(0.001)
        piece[:] = b"\1" * len(piece)

    k = 0
    while True:
        k += 1
        tracer = _AtLine(k, lambda code: code.co_filename == PARALLEL)
        outcome = {}

        def call():
            sys.settrace(tracer)
            try:
                parallel.in_pieces(read, 0, buffer)
                outcome["done"] = True
            except KeyboardInterrupt as e:
                outcome["interrupted"] = str(e)
            finally:
                sys.settrace(None)

        caller = threading.Thread(target=call)
        caller.start()
        caller.join(10)
        assert not caller.is_alive(), f"in_pieces hangs after an interrupt at its line {k}"
        if "done" in outcome and tracer.count < k:
            break
        snapshot = bytes(buffer)
        assert _helpers_end(), f"helpers left after an interrupt at line {k}: {outcome}"
        assert bytes(buffer) == snapshot, f"written after the call raised: {outcome}"
        buffer[:] = bytes(len(buffer))
    assert k > 20, "the trace reached the lines of in_pieces"


# -- the file changing under the load ---------------------------------------------------


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(100, 110)
        self.b = nn.Linear(110, 90)


def _checkpoints(tmp_path):
    torch.manual_seed(5)
    first = {k: torch.randn(v.shape) for k, v in Pair().state_dict().items()}
    second = {k: torch.randn(v.shape) for k, v in Pair().state_dict().items()}
    second["extra"] = torch.zeros(1000)  # a newer save: other positions
    path, newer = tmp_path / "model.safetensors", tmp_path / "newer.safetensors"
    save_file(first, str(path))
    save_file(second, str(newer), metadata={"step": "2" * 300})
    return path, newer


def test_a_file_replaced_after_the_replay_checked_it_is_refused_not_read(tmp_path, monkeypatch):
    """A newer save put at the path (os.replace) once the replay checked the files
    at its start, before it opens one to read: its bytes lie elsewhere. They
    were read at the old positions, silently; now CheckpointReadError names the
    file, every tensor stays deferred, and a load of the new file gives eager's values."""
    path, newer = _checkpoints(tmp_path)
    eager = Pair()
    eager.load_state_dict(load_file(str(newer)), strict=False)
    m = deferred_init(Pair)
    load_checkpoint(m, path)
    real_open = files.open_to_read
    swapped = []

    def swap_first(p, entry):
        if not swapped:
            os.replace(newer, path)
            swapped.append(p)
        return real_open(p, entry)

    monkeypatch.setattr(files, "open_to_read", swap_first)
    with pytest.raises(CheckpointReadError, match=f"{path} changed while"):
        materialize_module(m)
    assert swapped and all(is_deferred(t) for t in m.state_dict(keep_vars=True).values())
    monkeypatch.setattr(files, "open_to_read", real_open)
    load_checkpoint(m, path, strict=False)
    materialize_module(m)
    assert _same(eager, m) == []


def test_a_file_rewritten_in_place_while_it_is_read_is_refused(tmp_path, monkeypatch):
    """Another process rewrites the file in place (same size) after the first read:
    the tensors read after it would hold the new bytes, those before the old."""
    path, _ = _checkpoints(tmp_path)
    m = deferred_init(Pair)
    load_checkpoint(m, path)
    real_reader = files.Source.reader
    rewritten = []

    def reader(entry, fd):
        read = real_reader(entry, fd)

        def then_rewrite(position, buffer):
            read(position, buffer)
            if not rewritten:
                with open(path, "r+b") as f:
                    f.seek(-64, os.SEEK_END)
                    f.write(b"\x7f" * 64)
                st = os.stat(path)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
                rewritten.append(entry.key)

        return then_rewrite

    monkeypatch.setattr(files.Source, "reader", staticmethod(reader))
    with pytest.raises(CheckpointReadError, match=f"{path} changed while"):
        materialize_module(m)
    assert rewritten and all(is_deferred(t) for t in m.state_dict(keep_vars=True).values())


# -- a read error or an interrupt in one piece ------------------------------------------


class Wide(nn.Module):
    """Tensors of several pieces (one straddling them), a transposed parameter, small ones."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(1000, 1100)
        self.t = nn.Parameter(torch.randn(1200, 700).t())
        self.c = nn.Linear(7, 3)


@pytest.fixture
def wide(tmp_path):
    path = tmp_path / "wide.safetensors"
    torch.manual_seed(5)
    save_file({k: torch.randn(v.shape) for k, v in Wide().state_dict().items() if k != "c.bias"}, str(path))
    torch.manual_seed(0)
    eager = Wide()
    eager.load_state_dict(load_file(str(path)), strict=False)
    return path, eager, torch.get_rng_state()


def _failing_preadv(monkeypatch, n, make):
    """os.preadv raising ``make()`` at its n-th call (in whichever thread makes it)."""
    real = os.preadv
    calls = [0]
    lock = threading.Lock()

    def preadv(fd, buffers, position, *rest):
        with lock:
            calls[0] += 1
            mine = calls[0]
        if mine == n:
            raise make()
        return real(fd, buffers, position, *rest)

    monkeypatch.setattr(os, "preadv", preadv)
    return calls


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("what", ["io_error", "interrupt"])
def test_a_failure_in_any_piece_leaves_everything_deferred_and_a_second_call_is_eager(wide, threads, what, monkeypatch):
    """os.preadv fails at its n-th call, for every n: nothing is materialized, the
    generator is as it was, no helper is left, and the error names the file (an
    I/O error was a ReplayError about 'replaying load (node %14)' that did not);
    then a second call gives eager's values and generator."""
    path, eager, eager_rng = wide
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    make = (lambda: OSError(errno.EIO, "Input/output error")) if what == "io_error" else KeyboardInterrupt
    try:
        n = 0
        while True:
            n += 1
            torch.manual_seed(0)
            m = deferred_init(Wide)
            load_checkpoint(m, path, strict=False)
            rng = torch.get_rng_state()
            calls = _failing_preadv(monkeypatch, n, make)
            failed = None
            try:
                materialize_module(m)
            except (CheckpointReadError, KeyboardInterrupt) as e:
                failed = e
            monkeypatch.undo()
            if failed is None:
                assert calls[0] < n and n > 3
                break
            if what == "io_error":
                assert isinstance(failed, CheckpointReadError) and f"of {path}: Input/output error" in str(failed), failed
            assert all(is_deferred(t) for t in m.state_dict(keep_vars=True).values()), n
            assert torch.equal(torch.get_rng_state(), rng), n
            assert _helpers_end(), n
            materialize_module(m)
            assert _same(eager, m) == [], n
            assert torch.equal(torch.get_rng_state(), eager_rng), n
    finally:
        torch.set_num_threads(before)
