"""The liveness pass's lanes (deferinit/ir/liveness.py) find what its general
backward scan finds: same nodes, same modes, same allocations, scratch and
parts, on records where the lane applies and where something else touches
the storage (a view, a tie, a second write, a load, a factory read twice);
and materialization through them equals eager construction."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import deferinit.ir.liveness as liveness
from deferinit import deferred_init
from deferinit.ir.plan import Plan, read_of
from deferinit.materialize import materialize_module
from helpers import assert_same_tensors


class _Viewed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("flat", self.lin.weight.detach().view(-1))


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.normal_()
            self.lin.bias.mul_(2)


class _ReadBetween(nn.Module):
    def __init__(self):
        super().__init__()
        t = torch.zeros(4, 4)
        self.register_buffer("copy", t.clone())  # reads the factory's output before the fill
        t.uniform_()
        self.register_buffer("t", t)


class _Many(nn.Module):
    def __init__(self):
        super().__init__()
        self.ls = nn.ModuleList(nn.Linear(3, 5) for _ in range(6))
        self.ps = nn.ParameterList(nn.Parameter(torch.empty(7).normal_()) for _ in range(4))
        self.register_buffer("z", torch.zeros(3))
        self.register_buffer("o", torch.empty(2, 3).fill_(1.5))


def _loaded():
    m = _Many()
    m.load_state_dict({k: torch.ones_like(v) for k, v in m.state_dict().items() if k.startswith("ls.0")}, strict=False)
    return m


BUILDERS = {
    "linear": lambda: nn.Linear(4, 4),
    "many": _Many,
    "viewed": _Viewed,
    "tied": _Tied,
    "twice": _Twice,
    "read-between": _ReadBetween,
    "loaded": _loaded,
    "transformer": lambda: nn.TransformerEncoderLayer(8, 2, 16),
    "embedding": lambda: nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 2)),
}


def _summary(plan: Plan) -> tuple:
    lv = plan.liveness
    seq = {id(n): n.seq for n in lv.universe.values()}
    return (
        [n.seq for n in plan.order],
        sorted((seq[k], v) for k, v in lv.modes.items()),
        sorted((seq[k], sorted(v)) for k, v in lv.alloc.items()),
        sorted((seq[k], sorted(v)) for k, v in lv.scratch.items()),
        sorted((seq[k], v) for k, v in lv.parts.items()),
    )


def _plans(m, subset):
    tensors = [t for t in list(m.parameters()) + list(m.buffers())]
    tensors = list({id(t): t for t in tensors}.values())
    if subset:
        tensors = tensors[1::2]
    reads = [read_of(t) for t in tensors]
    lane = Plan(reads)
    liveness._FILL_LANE = False
    try:
        general = Plan(reads)
    finally:
        liveness._FILL_LANE = True
    return lane, general


@pytest.mark.parametrize("subset", [False, True])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_fill_lane_finds_what_the_general_scan_finds(name, subset):
    torch.manual_seed(0)
    m = deferred_init(BUILDERS[name])
    lane, general = _plans(m, subset)
    assert _summary(lane) == _summary(general)


def test_fill_lane_applies_to_linear_layers():
    """Not vacuous: nn.Linear's weight and bias (``empty`` then ``uniform_``) take the lane."""
    torch.manual_seed(0)
    m = deferred_init(_Many)
    reads = [read_of(t) for t in m.parameters()]
    fills, allocated = liveness._filled(reads, Plan(reads).liveness.universe, lambda inp: False)
    assert len(fills) == len(allocated) == 12 + 4


def test_fill_lane_skips_a_storage_read_elsewhere():
    torch.manual_seed(0)
    m = deferred_init(_Viewed)
    reads = [read_of(m.lin.weight)]
    fills, _ = liveness._filled(reads, Plan([read_of(m.lin.weight), read_of(m.flat)]).liveness.universe,
                                lambda inp: False)
    assert not fills


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_materialized_through_the_lane_equals_eager(name):
    torch.manual_seed(0)
    eager = BUILDERS[name]()
    after_eager = torch.rand(4)
    torch.manual_seed(0)
    m = deferred_init(BUILDERS[name])
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(4), after_eager)


class _Factories(nn.Module):
    def __init__(self, extra=False):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(3)) for _ in range(5))
        self.register_buffer("z", torch.zeros(2))
        if extra:
            self.register_buffer("y", self.z + 1)  # not a factory's own output


@pytest.mark.parametrize("extra", [False, True])
def test_all_whole_skips_the_scan_and_finds_what_it_finds(extra, monkeypatch):
    """A universe of targets' factory calls and nothing else is planned without
    the scan (every node live, run as recorded); the scan finds the same."""
    torch.manual_seed(0)
    m = deferred_init(_Factories, extra)
    reads = [read_of(t) for t in list(m.parameters()) + list(m.buffers())]
    shortcut = Plan(reads)
    assert (shortcut.liveness is None) is not extra
    monkeypatch.setattr("deferinit.ir.plan.whole_factories", lambda *args: None)
    scanned = Plan(reads)
    assert [n.seq for n in shortcut.order] == [n.seq for n in scanned.order]
    if not extra:
        lv = scanned.liveness
        assert not lv.modes and not lv.alloc and not lv.scratch and not lv.parts
