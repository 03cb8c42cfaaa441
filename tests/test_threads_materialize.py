"""Threads materializing one model at once: eager's values, every Parameter a Parameter.

Several threads ask for the same tensors: the same module, overlapping
submodules, one tensor and its module, a checkpoint load, a change recorded
after deferral, a new deferral reading values meanwhile.  One call
materializes, the others wait for it and find their tensors done
(deferinit/exclusive.py).  The overlaps are forced (tests/overlap.py: the
first call is held inside its work until the others have got as far as they
can), each case is repeated, and every result is compared with eager
construction: values, Parameter classes, ties, views, and the generator
afterwards.
"""

from __future__ import annotations

import importlib
import random
import threading

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init, is_deferred
from deferinit.materialize import load_checkpoint, materialize_module, materialize_tensor
from deferinit.materialize.replay import Replay
from helpers import assert_same_tensors
from overlap import TIMEOUT, overlapped

REPEAT = 8
REPLAY = (Replay, "run")
CHECKPOINT_API = importlib.import_module("deferinit.materialize.checkpoint.api")
LOAD = (CHECKPOINT_API, "walk")  # load_checkpoint deciding, tensor by tensor, deferred or real


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)
        self.register_buffer("scale", torch.rand(d))


class Net(nn.Module):
    """Default-generator draws, a data-dependent initialiser, a tie, a buffer
    viewing another submodule's buffer."""

    def __init__(self, d: int = 8, n: int = 3):
        super().__init__()
        self.embed = nn.Embedding(11, d)
        nn.init.trunc_normal_(self.embed.weight, std=0.5)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 11, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("row", self.blocks[1].scale[2:6])
        self.gate = nn.Parameter(torch.randn(d))


def _eager(seed=0, after=None):
    torch.manual_seed(seed)
    m = Net()
    if after is not None:
        after(m)
    return m, torch.rand(5)


def _deferred(seed=0):
    torch.manual_seed(seed)
    return deferred_init(Net)


def _check(eager, next_draw, m):
    """``m`` is eager's; the generator too, unless ``next_draw`` is None (after a
    checkpoint load, whose tensors' draws the generator waits for: docs/guide.md, "Loading a checkpoint")."""
    assert not is_deferred(m)
    assert_same_tensors(eager, m)
    assert all(type(p) is nn.Parameter for p in m.parameters())
    assert m.row.untyped_storage().data_ptr() == m.blocks[1].scale.untyped_storage().data_ptr()
    if next_draw is not None:
        assert torch.equal(torch.rand(5), next_draw), "the generator is not where eager construction left it"


def _all(m):
    return lambda: materialize_module(m)


@pytest.mark.parametrize("others", [1, 3])
def test_same_module_from_several_threads(monkeypatch, others):
    eager, next_draw = _eager()
    for _ in range(REPEAT):
        m = _deferred()
        overlapped(monkeypatch, _all(m), [_all(m)] * others, [REPLAY])
        _check(eager, next_draw, m)


@pytest.mark.parametrize("first, other", [
    ("blocks.1", ""), ("", "blocks.1"), ("blocks", "blocks.1"), ("blocks.1", "blocks"), ("head", "embed"),
])
def test_overlapping_submodules(monkeypatch, first, other):
    eager, next_draw = _eager()
    for _ in range(REPEAT):
        m = _deferred()
        overlapped(
            monkeypatch, _all(m.get_submodule(first)), [_all(m.get_submodule(other)), _all(m.blocks[2])], [REPLAY]
        )
        materialize_module(m)  # the rest
        _check(eager, next_draw, m)


def test_several_overlapping_requests_in_every_order(monkeypatch):
    """Four threads, each a different request covering parts of the others; the
    first call is each of them in turn."""
    eager, next_draw = _eager()
    requests = [
        lambda m: materialize_module(m.blocks),
        lambda m: materialize_tensor(m.head.weight),
        lambda m: materialize_tensor(m.row),
        lambda m: materialize_module(m),
    ]
    for _ in range(2):
        for i in range(len(requests)):
            m = _deferred()
            calls = [lambda r=r: r(m) for r in requests]
            overlapped(monkeypatch, calls[i], calls[:i] + calls[i + 1:], [REPLAY])
            _check(eager, next_draw, m)


@pytest.mark.parametrize("tensor_first", [True, False])
def test_materialize_tensor_beside_its_module(monkeypatch, tensor_first):
    eager, next_draw = _eager()
    for _ in range(REPEAT):
        m = _deferred()
        weight, view = m.embed.weight, m.row
        tensors = [lambda: materialize_tensor(m.head.weight), lambda: materialize_tensor(view)]
        if tensor_first:
            overlapped(monkeypatch, tensors[0], [_all(m), tensors[1]], [REPLAY])
        else:
            overlapped(monkeypatch, _all(m), tensors, [REPLAY])
        assert m.embed.weight is weight and m.row is view  # the same objects, now real
        _check(eager, next_draw, m)


def _checkpoint():
    g = torch.Generator().manual_seed(1)
    return {
        "blocks.0.fc.weight": torch.randn(16, 8, generator=g),
        "embed.weight": torch.randn(11, 8, generator=g),
        "blocks.1.scale": torch.rand(8, generator=g),
        "gate": torch.randn(8, generator=g),
    }


@pytest.mark.parametrize("load_first", [True, False])
def test_load_checkpoint_beside_materialization(monkeypatch, load_first):
    """Loading while another thread materializes: the loaded values win, whichever
    call runs first, as they do eagerly (load_state_dict after construction)."""
    sd = _checkpoint()
    eager, _ = _eager(after=lambda m: m.load_state_dict(sd, strict=False))
    for _ in range(REPEAT):
        m = _deferred()
        load = lambda: load_checkpoint(m, sd, strict=False)  # noqa: E731
        if load_first:
            overlapped(monkeypatch, load, [_all(m.blocks), _all(m)], [LOAD, REPLAY])
        else:
            overlapped(monkeypatch, _all(m), [load], [LOAD, REPLAY])
        materialize_module(m)
        _check(eager, None, m)


def _change(m):
    with torch.no_grad():
        m.blocks[0].fc.weight.mul_(2)
        m.gate.add_(m.blocks[2].scale)


def test_change_recorded_beside_materialization(monkeypatch):
    """A change to the deferred model (recorded after deferral) while another thread
    materializes it: kept, as eagerly, also when the tensors became real while
    the change waited."""
    eager, next_draw = _eager(after=_change)
    for _ in range(REPEAT):
        m = _deferred()
        overlapped(monkeypatch, _all(m), [lambda: _change(m)], [REPLAY])
        _check(eager, next_draw, m)


class Reads(nn.Module):
    """A constructor that reads a value of what it made (``.item()``)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        scale = self.w.abs().max().item()
        self.register_buffer("b", torch.rand(3) * scale)


def test_new_deferral_beside_materialization(monkeypatch):
    """A thread defers a model (drawing from the default generator, reading a
    value) while another materializes the model deferred just before it: both
    as eager built them one after the other, and the generator after both."""
    torch.manual_seed(0)
    eager_net, eager_reads, next_draw = Net(), Reads(), None
    next_draw = torch.rand(5)
    for _ in range(REPEAT):
        m = _deferred()
        made = {}
        overlapped(monkeypatch, _all(m), [lambda: made.setdefault("r", deferred_init(Reads))], [REPLAY])
        materialize_module(made["r"])
        assert_same_tensors(eager_net, m)
        assert_same_tensors(eager_reads, made["r"])
        assert torch.equal(torch.rand(5), next_draw)


def test_unforced_mix_of_requests():
    """No forcing: four threads released by a barrier, each a random sequence of
    requests on one model (submodules, tensors, the checkpoint), many times."""
    sd = _checkpoint()
    eager, _ = _eager(after=lambda m: m.load_state_dict(sd, strict=False))
    rng = random.Random(0)
    names = [n for n, _ in Net().named_modules()]
    for _ in range(30):
        m = _deferred()
        load_checkpoint(m, sd, strict=False)
        barrier = threading.Barrier(4, timeout=TIMEOUT)
        plans = [[rng.choice(names) for _ in range(3)] for _ in range(4)]
        errors = []

        def worker(plan):
            try:
                barrier.wait()
                for name in plan:
                    sub = m.get_submodule(name)
                    tensors = list(sub.parameters(recurse=False))
                    if tensors and rng.random() < 0.3:
                        materialize_tensor(tensors[0])
                    else:
                        materialize_module(sub)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(p,), daemon=True) for p in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
            assert not t.is_alive()
        assert not errors, errors[0]
        materialize_module(m)
        _check(eager, None, m)


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)
def test_sharded_materialization_from_several_threads():
    """FSDP2 on two ranks; on each, a block, the whole model and one DTensor
    parameter materialized from three threads at once, each first in turn."""
    import thread_workers
    from multiproc import run_ranks

    assert run_ranks(thread_workers.case_fsdp2_threads, 2, 6, timeout=240) == [6, 6]
