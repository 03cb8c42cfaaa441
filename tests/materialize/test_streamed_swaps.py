"""A plan of the targets' own factory calls swaps each plain tensor in as the
replay makes it (``Replay.run(sink=...)``, ``pipeline._streamed``): values,
generators, all or nothing on failure and on an interrupt at any line, the
tensors it leaves to the pass over all, and the planner's shortcut
(``plan.draws_outside``) against the walk it replaces; always against eager.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init, is_deferred
from deferinit.errors import MaterializationError
from deferinit.ir.plan import Plan, draws_before, draws_outside, read_of
from deferinit.materialize import materialize_module, materialize_tensor
from deferinit.materialize.draws import Draws
from deferinit.materialize.swap import Swaps
from helpers import assert_same_tensors
from test_interrupts import all_or_nothing, interrupted_at

G = torch.Generator()


class Plain(nn.Module):
    """Only factory calls, each a tensor of its own: the streamed path."""

    def __init__(self, n=6):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(3)) for _ in range(n))
        self.register_buffer("z", torch.zeros(2, 3))
        self.q = nn.Parameter(torch.rand(4, generator=G))  # another generator
        self.register_buffer("o", torch.ones(5, dtype=torch.float64))
        self.r = nn.Parameter(torch.randn(2, 2, dtype=torch.float16))  # another dtype: a run ends


class Mixed(Plain):
    """Factory calls only, but some tensors are left to the pass over all:
    one shared, one an inference tensor, one autograd saw a view taken of;
    and one with a gradient hook, streamed with it."""

    def __init__(self):
        super().__init__(n=4)
        self.register_buffer("s", torch.randn(3))
        self.s.share_memory_()
        with torch.inference_mode():
            self.register_buffer("i", torch.rand(2))
        self.v = nn.Parameter(torch.randn(3))
        _ = self.v[0:2]
        self.h = nn.Parameter(torch.randn(3))
        self.h.register_hook(lambda g: g * 10)


def _eager(cls):
    torch.manual_seed(0)
    G.manual_seed(1)
    m = cls()
    return m, torch.get_rng_state(), G.get_state()


def _deferred(cls):
    torch.manual_seed(0)
    G.manual_seed(1)
    return deferred_init(cls)


def _held(m):
    return dict(m.named_parameters(), **dict(m.named_buffers()))


@pytest.fixture
def ones_counted(monkeypatch):
    """How many tensors the replay swapped in itself."""
    calls = []
    one = Swaps.one
    monkeypatch.setattr(Swaps, "one", lambda self, *a: calls.append(1) or one(self, *a))
    return calls


@pytest.mark.parametrize("cls", [Plain, Mixed])
def test_values_and_generators_equal_eager(cls, ones_counted):
    eager, state, g = _eager(cls)
    d = _deferred(cls)
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(G.get_state(), g)
    plain = len(_held(d)) - (3 if cls is Mixed else 0)
    assert len(ones_counted) == plain  # the mechanism ran: all but the three left
    if cls is Mixed:
        assert d.s.is_shared() and d.i.is_inference() and not d.i.requires_grad
        d.h.sum().backward()
        assert torch.equal(d.h.grad, torch.full((3,), 10.0))
    for name, t in _held(d).items():
        assert type(t) is type(_held(eager)[name]) and t.requires_grad == _held(eager)[name].requires_grad, name


def test_one_tensor_and_then_the_rest():
    eager, state, g = _eager(Plain)
    d = _deferred(Plain)
    assert materialize_tensor(d.ps[3]) is d.ps[3] and not is_deferred(d.ps[3])
    assert torch.equal(d.ps[3], eager.ps[3])
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(G.get_state(), g)


@pytest.mark.parametrize("at", [1, 3, 5])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_draw_failing_midway_undoes_the_tensors_swapped_before(at, error, monkeypatch):
    """Tensors swapped in before the failing draw are deferred again, the
    generators are as they were, and a second call gives eager's values."""
    eager, state, g = _eager(Plain)
    d = _deferred(Plain)
    before, g_before = torch.get_rng_state(), G.get_state()
    follow, count = Draws.follow, [0]

    def failing(self, *args):
        count[0] += 1
        if count[0] == at:
            raise error("injected")
        return follow(self, *args)

    monkeypatch.setattr(Draws, "follow", failing)
    with pytest.raises(Exception if error is RuntimeError else KeyboardInterrupt):
        materialize_module(d)
    assert count[0] == at
    assert all(is_deferred(t) for t in _held(d).values())
    assert torch.equal(torch.get_rng_state(), before) and torch.equal(G.get_state(), g_before)
    monkeypatch.setattr(Draws, "follow", follow)
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(G.get_state(), g)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WATCHED = {
    os.path.join(ROOT, "materialize", "replay.py"): {"_run_whole", "run"},
    os.path.join(ROOT, "materialize", "pipeline.py"): {"sink", "_streamed", "_swap_in", "_run", "_plain_leaf"},
    os.path.join(ROOT, "materialize", "swap.py"): {"one", "_swap", "_remember", "_noted", "dress_fresh", "_class_of"},
    os.path.join(ROOT, "deferinit", "ir", "plan.py"): {"draws_outside", "_positions", "_plan"},
}


@pytest.mark.parametrize("cls", [Plain, Mixed])
def test_an_interrupt_at_each_line_leaves_all_or_nothing(cls):
    eager, state, g = _eager(cls)
    k, hit = 1, 0
    while True:
        d = _deferred(cls)
        before, g_before = torch.get_rng_state(), G.get_state()
        where = interrupted_at(k, lambda code: code.co_name in WATCHED.get(code.co_filename, ()),
                               lambda: materialize_module(d))
        if where is None:
            break
        hit += 1
        all_or_nothing(d, where, lambda: torch.equal(torch.get_rng_state(), before) and torch.equal(G.get_state(), g_before))
        materialize_module(d)
        assert_same_tensors(eager, d)
        assert torch.equal(torch.get_rng_state(), state) and torch.equal(G.get_state(), g), where
        k += 3
    assert hit > 40, hit


def _seeded_midway():
    ps = [nn.Parameter(torch.randn(2)) for _ in range(4)]
    torch.manual_seed(5)  # an event inside the run
    ps += [nn.Parameter(torch.randn(2)) for _ in range(4)]
    return nn.ParameterList(ps)


def _forked():
    ps = [nn.Parameter(torch.randn(2)) for _ in range(3)]
    with torch.random.fork_rng():  # the state after a draw put back: a walk jumps over what fork_rng drew
        ps += [nn.Parameter(torch.randn(2)) for _ in range(3)]
    ps += [nn.Parameter(torch.randn(2)) for _ in range(3)]
    return nn.ParameterList(ps)


G2 = torch.Generator()


def _put_back():
    G2.manual_seed(0)
    ps = [nn.Parameter(torch.randn(2, generator=G2)) for _ in range(2)]
    saved = G2.get_state()
    G2.manual_seed(7)  # a fact the walk from the run's first draw stops at...
    ps += [nn.Parameter(torch.randn(2, generator=G2)) for _ in range(2)]
    G2.set_state(saved)  # ...and the state after draw 1 put back: a walk from here jumps below it
    ps += [nn.Parameter(torch.randn(2, generator=G2)) for _ in range(4)]
    return nn.ParameterList(ps)


def _plain(n=8):
    return nn.ParameterList(nn.Parameter(torch.randn(2)) for _ in range(n))


@pytest.mark.parametrize("build", [_plain, _seeded_midway, _forked, _put_back])
@pytest.mark.parametrize("pick", ["all", "tail", "middle", "every-other", "last", "first-and-last"])
def test_draws_outside_adds_what_draws_before_adds(build, pick):
    """The shortcut finds the same draws outside the planned ones as the walk from every draw."""
    torch.manual_seed(0)
    d = deferred_init(build)
    ps = list(d)
    chosen = {
        "all": ps, "tail": ps[2:], "middle": ps[2:6], "every-other": ps[::2], "last": ps[-1:],
        "first-and-last": [ps[0], ps[-1]],
    }[pick]
    plan = Plan([read_of(p) for p in chosen])
    nodes = [read_of(p).value.node for p in chosen]
    ids = {id(n) for n in nodes}
    full = {id(n) for n in draws_before(nodes, plan.streams) if id(n) not in ids}
    fast = {id(n) for n in draws_outside(nodes, plan.streams) if id(n) not in ids}
    assert fast == full
    # and materializing those tensors alone still gives eager's values and generator
    torch.manual_seed(0)
    eager = build()
    after = torch.get_rng_state()
    at = {id(p): i for i, p in enumerate(ps)}
    for p in chosen:
        materialize_tensor(p)
        assert torch.equal(p, eager[at[id(p)]])
    if pick == "all":
        assert torch.equal(torch.get_rng_state(), after)


@pytest.mark.parametrize("others", ["module", "tensor", "submodule"])
def test_threads_asking_while_tensors_stream_in(monkeypatch, others):
    """Other threads asking for the same tensors while the first call is
    half-way through swapping them in: they wait for it, and every tensor
    is eager's, a Parameter where eager's is."""
    from overlap import overlapped

    eager, state, g = _eager(Plain)
    for _ in range(4):
        d = _deferred(Plain)
        asks = {
            "module": lambda: materialize_module(d),
            "tensor": lambda: materialize_tensor(d.ps[4]),
            "submodule": lambda: materialize_module(d.ps),
        }
        overlapped(monkeypatch, lambda: materialize_module(d), [asks[others]] * 2, [(Swaps, "one")])
        assert_same_tensors(eager, d)
        assert all(type(p) is nn.Parameter for p in d.parameters())
        assert torch.equal(torch.get_rng_state(), state) and torch.equal(G.get_state(), g)


class Tagged(nn.Parameter):
    pass


class Classes(nn.Module):
    """Parameter classes, flags and attributes the replay's own tensor is dressed
    with in place (dress_fresh)."""

    def __init__(self):
        super().__init__()
        self.a = Tagged(torch.randn(3))
        self.b = nn.Parameter(torch.randn(2))
        self.c = nn.Parameter(torch.randn(2), requires_grad=False)
        self.d = nn.Parameter(torch.randint(0, 5, (3,)), requires_grad=False)
        self.e = nn.Parameter(torch.randn(2, dtype=torch.complex64))
        self.register_buffer("f", torch.rand(3))
        self.f.tag = "mine"
        self.g = nn.Parameter(torch.randn(2))
        self.g.tag = "mine too"


def test_classes_flags_and_attributes_as_eager(ones_counted):
    eager, state, g = _eager(Classes)
    d = _deferred(Classes)
    materialize_module(d)
    assert_same_tensors(eager, d)
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(G.get_state(), g)
    assert len(ones_counted) == 7  # all streamed
    for name, t in _held(d).items():
        e = _held(eager)[name]
        assert type(t) is type(e) and t.requires_grad == e.requires_grad and t.is_leaf, name
        assert t.__dict__ == e.__dict__, name
    d.a.sum().backward()  # each a leaf autograd accumulates into
    assert torch.equal(d.a.grad, torch.ones(3))


OUTSIDE = torch.arange(3.0)


class Outside(nn.Module):
    """A parameter pointed at a tensor from outside (``.data =``): the replay's
    value is that tensor object itself, which must stay the user's."""

    def __init__(self):
        super().__init__()
        self.q = nn.Parameter(torch.randn(2))
        self.p = nn.Parameter(torch.randn(3))
        self.p.data = OUTSIDE


def test_an_outside_tensor_stays_the_users(ones_counted):
    eager, _, _ = _eager(Outside)
    d = _deferred(Outside)
    materialize_module(d)
    assert len(ones_counted) == 2
    assert_same_tensors(eager, d)
    # Without the node-kind check, OUTSIDE itself was dressed as the Parameter
    # and then swapped out: a FakeTensor.
    assert type(OUTSIDE) is torch.Tensor and not OUTSIDE.requires_grad
    assert type(d.p) is nn.Parameter and d.p is not OUTSIDE and d.p.data_ptr() == OUTSIDE.data_ptr()
    assert eager.p.data_ptr() == OUTSIDE.data_ptr()


class Slotted(nn.Parameter):
    """A parameter class of another layout: no object can be swapped into it."""

    __slots__ = ("note",)


def test_a_parameter_class_of_another_layout_is_refused_and_nothing_changes():
    def build():
        return nn.ParameterList([nn.Parameter(torch.randn(2)), Slotted(torch.randn(2)), nn.Parameter(torch.randn(2))])

    torch.manual_seed(0)
    d = deferred_init(build)
    before = torch.get_rng_state()
    with pytest.raises(MaterializationError, match="swapping the real tensors in failed: __class__ assignment"):
        materialize_module(d)
    assert all(is_deferred(p) for p in d)
    assert torch.equal(torch.get_rng_state(), before)
