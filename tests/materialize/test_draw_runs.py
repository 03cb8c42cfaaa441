"""Runs of random factories replayed one after the other (Replay's batched steps,
``Draws.follow``): equal to eager wherever a run is cut or continued.

A run is broken by what stands between two draws of one generator: a
reseed, a state put back (``fork_rng``), a state a later replay looks up,
another generator's draw, a non-random node, another default dtype.  Each
model below puts one of those among runs of ``randn``/``rand``/``randint``/
``randperm``/``normal`` factories and is compared with eager construction:
values, the generator afterwards, and materialization in any order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from deferinit.materialize import materialize_module, materialize_tensor
from helpers import assert_same_tensors, check_exact, materialize_in_order

EXPLICIT = torch.Generator()


def _factories(i: int) -> torch.Tensor:
    kind = i % 10
    if kind == 6:
        return torch.empty(3, 2).uniform_(-0.5, 0.5)  # a fill of an allocation
    if kind == 7:
        return nn.init.kaiming_uniform_(torch.empty(4, 3), a=5 ** 0.5)
    if kind == 8:
        return torch.empty(5, dtype=torch.float64).normal_()
    if kind == 9:
        return torch.empty(2, 2).exponential_()
    if kind == 0:
        return torch.randn(3)
    if kind == 1:
        return torch.rand(2, 2, dtype=torch.float64)  # two words a value
    if kind == 2:
        return torch.randint(0, 10, (5,)).float()
    if kind == 3:
        return torch.randperm(7).float()
    if kind == 4:
        return torch.normal(0.5, 2.0, (4,))
    return torch.randn(17)  # normal_'s vectorised path (16 and more)


class Runs(nn.Module):
    """Many small random parameters, with ``breaker(i)`` run before the i-th."""

    def __init__(self, n: int, breaker=None):
        super().__init__()
        ps, kept = [], []
        for i in range(n):
            if breaker is not None:
                t = breaker(i)
                if t is not None:
                    kept.append(nn.Parameter(t))
            ps.append(nn.Parameter(_factories(i)))
        self.ps = nn.ParameterList(ps)
        self.kept = nn.ParameterList(kept)


def _reseed(i):
    if i % 7 == 3:
        torch.manual_seed(i)


def _fork(i):
    if i % 5 == 2:
        with torch.random.fork_rng():
            torch.randn(3)


def _fork_kept(i):
    # Drawn inside and kept: the state after the draw before is looked up
    # once the fork puts it back.
    if i % 5 == 2:
        with torch.random.fork_rng():
            return torch.randn(3)


def _explicit(i):
    if i % 4 == 1:
        torch.randn(2, generator=EXPLICIT)


def _dtype(i):
    torch.set_default_dtype(torch.float64 if i % 3 == 0 else torch.float32)


def _reads(i):
    # A draw whose state nothing records, then a computation (not random).
    if i % 6 == 5:
        torch.ones(2).mul_(3)


BREAKERS = [None, _reseed, _fork, _fork_kept, _explicit, _dtype, _reads]


@pytest.fixture(autouse=True)
def _default_dtype():
    yield
    torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("breaker", BREAKERS, ids=lambda b: getattr(b, "__name__", "none"))
def test_runs_equal_eager_and_leave_the_generator_as_eager(breaker):
    EXPLICIT.manual_seed(7)
    check_exact(Runs, 60, breaker)


@pytest.mark.parametrize("order", ["reverse", 11, 12])
@pytest.mark.parametrize("breaker", [None, _reseed, _fork, _fork_kept], ids=lambda b: getattr(b, "__name__", "none"))
def test_runs_cut_by_materializing_one_tensor_at_a_time(breaker, order):
    check_exact(Runs, 40, breaker, order=order)


class Linears(nn.Module):
    """nn.Linear's empty, empty, uniform_, uniform_ in runs, with ``breaker``
    between layers and a weight read by a later computation."""

    def __init__(self, n: int, breaker=None):
        super().__init__()
        layers = []
        for i in range(n):
            if breaker is not None:
                breaker(i)
            layers.append(nn.Linear(3, 2, dtype=torch.float64 if i % 4 == 1 else None))
        self.layers = nn.ModuleList(layers)
        self.register_buffer("norm", self.layers[2].weight.detach().norm())


@pytest.mark.parametrize("order", ["module", "reverse", 3])
@pytest.mark.parametrize("breaker", [None, _reseed, _fork_kept, _dtype], ids=lambda b: getattr(b, "__name__", "none"))
def test_runs_of_allocations_and_fills(breaker, order):
    check_exact(Linears, 40, breaker, order=order)


class ExplicitRuns(nn.Module):
    """Runs on an explicit generator whose older state user code puts back: the
    draw after it starts from the state right after an earlier draw of a
    run (looked up when the replay reaches it)."""

    def __init__(self, n: int):
        super().__init__()
        ps = []
        for i in range(n):
            if i % 5 == 3:
                saved = EXPLICIT.get_state()
                ps.append(nn.Parameter(torch.randn(3, generator=EXPLICIT)))
                ps.append(nn.Parameter(torch.rand(3, generator=EXPLICIT)))
                EXPLICIT.set_state(saved)
            ps.append(nn.Parameter(torch.randn(2, generator=EXPLICIT)))
        self.ps = nn.ParameterList(ps)


@pytest.mark.parametrize("order", ["module", "reverse", 5])
def test_an_older_state_put_back_inside_a_run(order):
    EXPLICIT.manual_seed(11)
    eager = ExplicitRuns(30)
    eager_next = torch.rand(4, generator=EXPLICIT)
    EXPLICIT.manual_seed(11)
    d = deferred_init(ExplicitRuns, 30)
    if order == "module":
        materialize_module(d)
    else:
        materialize_in_order(d, order)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.rand(4, generator=EXPLICIT), eager_next)


def test_part_of_a_run_then_the_rest():
    torch.manual_seed(3)
    eager = Runs(50)
    after = torch.rand(4)
    torch.manual_seed(3)
    d = deferred_init(Runs, 50)
    # Every third tensor first: the draws between are jumped over, and the
    # replay of the rest learns the states the first left.
    for p in list(d.ps)[::3]:
        materialize_tensor(p)
    materialize_module(d)
    assert torch.equal(torch.rand(4), after)
    assert_same_tensors(eager, d)


def test_values_used_later_in_the_record_stay_available():
    class Used(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(4))
            self.b = nn.Parameter(torch.randn(4))
            self.register_buffer("c", self.a.detach() * 2 + self.b.detach())
            self.d = nn.Parameter(torch.randn(4))

    check_exact(Used)


def test_runs_are_taken(monkeypatch):
    """The models above do exercise runs (else these tests would prove nothing of them)."""
    from deferinit.materialize import draws

    followed = []
    original = draws.Draws.follow

    def spy(self, node, *args):
        followed.append(node)
        return original(self, node, *args)

    monkeypatch.setattr(draws.Draws, "follow", spy)
    materialize_module(deferred_init(Runs, 30, _reseed))
    assert len(followed) >= 2


def test_a_failing_draw_in_a_run_is_named_and_changes_nothing(monkeypatch):
    from deferinit import is_deferred
    from deferinit.errors import ReplayError
    from deferinit.materialize import draws

    original = draws.Draws.follow
    calls = []

    def failing(self, node, *args):
        calls.append(node)
        if len(calls) == 5:
            raise RuntimeError("simulated failure")
        return original(self, node, *args)

    monkeypatch.setattr(draws.Draws, "follow", failing)
    torch.manual_seed(0)
    m = deferred_init(lambda: nn.ParameterList(nn.Parameter(torch.randn(2)) for _ in range(10)))
    before = torch.get_rng_state()
    with pytest.raises(ReplayError, match="simulated failure") as info:
        materialize_module(m)
    # The draw that failed, not the first of its run.
    assert f"(node %{calls[4].seq})" in str(info.value)
    assert all(is_deferred(p) for p in m)
    assert torch.equal(torch.get_rng_state(), before)
