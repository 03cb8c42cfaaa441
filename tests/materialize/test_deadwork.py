"""Dead-work elimination (deferinit/ir/liveness.py): replay computes only what the
values read and the generator states depend on, and equals eager construction.

Every test compares against eager construction with the same seed (values and
the generator afterwards) and counts, with ``torch.profiler``, the kernels
that ran while materializing: replay runs below every dispatch mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

from deferinit import deferred_init
from deferinit.ir.plan import Plan, read_of
from helpers import assert_same_tensors, check_jump_models
from deferinit.materialize import materialize_module, materialize_tensor

N = 64


def kernels(fn) -> list[str]:
    check_jump_models()  # once per process, with kernels of its own: not in the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


def eager_and_kernels(build):
    torch.manual_seed(0)
    ran = kernels(lambda: build())
    torch.manual_seed(0)
    eager = build()
    return eager, torch.rand(8), ran


def deferred_and_kernels(build):
    torch.manual_seed(0)
    m = deferred_init(build)
    ran = kernels(lambda: materialize_module(m))
    return m, torch.rand(8), ran


class Holder(nn.Module):
    def __init__(self, body):
        super().__init__()
        body(self)


def _copy(self):
    t = torch.empty(N, N).uniform_()
    t.mul_(3)
    t.copy_(torch.arange(N * N, dtype=torch.float32).view(N, N))
    self.register_buffer("a", t)


def _fill_halves(self):
    t = torch.randn(N, N)
    t.mul_(3)
    t[: N // 2].fill_(1.0)
    t[N // 2 :].zero_()
    self.register_buffer("a", t)


def _setitem(self):
    t = torch.empty(N, N).normal_()
    t.mul_(3)
    t[:] = 2.5
    self.register_buffer("a", t)


def _data(self):
    p = nn.Parameter(torch.empty(N, N))
    nn.init.kaiming_uniform_(p)
    p.data.mul_(3)
    p.data = torch.ones(N, N)
    self.register_parameter("p", p)
    # A later draw needs the state the discarded one leaves.  (Without it no
    # tensor read draws from the stream, and no replay meets it.)
    self.register_buffer("b", torch.rand(3))


def _reset_then_init(self):
    # what transformers does: reset_parameters draws, _init_weights draws again
    lin = nn.Linear(N, N)
    lin.weight.data.mul_(3)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
        lin.bias.zero_()
    self.lin = lin


@pytest.mark.parametrize(
    "body, live_draws",
    [(_copy, 0), (_fill_halves, 0), (_setitem, 0), (_data, 1), (_reset_then_init, 1)],
    ids=lambda x: x.__name__[1:] if callable(x) else str(x),
)
def test_overwritten_work_does_not_run_and_values_and_generator_equal_eager(body, live_draws):
    def build():
        return Holder(body)

    eager, eager_next, eager_ran = eager_and_kernels(build)
    m, next_draw, ran = deferred_and_kernels(build)
    assert_same_tensors(eager, m)
    assert torch.equal(next_draw, eager_next)
    # The work whose result is overwritten does not run...
    assert "aten::mul_" in eager_ran and "aten::mul_" not in ran
    # ...nor do the draws whose results are dead: the generator jumps over
    # them (deferinit/random/jumps.py) and still ends where eager leaves it; only
    # the draws whose values are read run.
    random = lambda names: [n for n in names if n in ("aten::uniform_", "aten::normal_", "aten::random_")]  # noqa: E731
    assert len(random(eager_ran)) > len(random(ran)) == live_draws


def test_partial_overwrite_keeps_the_rest():
    def build():
        def body(self):
            t = torch.randn(N, N)
            t.mul_(3)
            t[1:].fill_(0.0)
            self.register_buffer("a", t)

        return Holder(body)

    eager, eager_next, _ = eager_and_kernels(build)
    m, next_draw, ran = deferred_and_kernels(build)
    assert_same_tensors(eager, m)
    assert torch.equal(next_draw, eager_next)
    assert "aten::mul_" in ran  # row 0 still needs it


def test_a_dead_draw_a_later_draw_needs_is_jumped():
    """``a``'s draw is overwritten, ``b``'s needs the state it leaves: the
    generator jumps over it; ``a`` is never allocated nor filled."""

    def build():
        def body(self):
            a = torch.empty(N, N).uniform_()
            a.fill_(0.5)
            self.register_buffer("a", a)
            self.register_buffer("b", torch.randn(3))

        return Holder(body)

    eager, _, _ = eager_and_kernels(build)
    torch.manual_seed(0)
    m = deferred_init(build)
    plan = Plan([read_of(m.b)])
    modes = {str(n.target): plan.mode(n) for n in plan.order}
    assert modes == {"aten.uniform_.default": "generator", "aten.randn.default": "run"}
    ran = kernels(lambda: materialize_tensor(m.b))
    assert "aten::uniform_" not in ran and "aten::fill_" not in ran and "aten::normal_" in ran
    assert torch.equal(m.b, eager.b)
    materialize_module(m)
    assert_same_tensors(eager, m)


def test_overwritten_factories_are_only_allocated():
    def build():
        def body(self):
            t = torch.zeros(N, N)
            t.copy_(torch.ones(N, N) * 2)
            self.register_buffer("a", t)

        return Holder(body)

    eager, _, eager_ran = eager_and_kernels(build)
    m, _, ran = deferred_and_kernels(build)
    assert_same_tensors(eager, m)
    assert eager_ran.count("aten::zeros") == 1 and "aten::zeros" not in ran


def test_views_keep_the_writes_their_base_needs():
    """A view read later sees every write to the bytes it covers."""

    def build():
        def body(self):
            t = torch.randn(4, N)
            v = t[2]
            t.fill_(1.0)
            v.mul_(5)
            t[0].normal_()
            self.register_buffer("t", t)
            self.register_buffer("v", v)

        return Holder(body)

    eager, eager_next, _ = eager_and_kernels(build)
    for order in ("module", "view first"):
        torch.manual_seed(0)
        m = deferred_init(build)
        if order == "view first":
            materialize_tensor(m.v)
        materialize_module(m)
        assert_same_tensors(eager, m)
        assert m.v.data_ptr() == m.t[2].data_ptr()
    assert torch.equal(torch.rand(8), eager_next)


def test_only_live_draws_run_for_a_transformer():
    """nn.Transformer re-initializes its matrices after the layers drew them:
    the layers' draws are jumped over, every other draw runs once."""
    build = lambda: nn.Transformer(32, 2, 1, 1, 64)  # noqa: E731
    eager, eager_next, eager_ran = eager_and_kernels(build)
    torch.manual_seed(0)
    m = deferred_init(build)
    plan = Plan([read_of(t) for t in [*m.parameters(), *m.buffers()]])
    live = sorted(f"aten::{n.target._opname}" for n in plan.order if n.rng is not None and plan.mode(n) == "run")
    dead = [n for n in plan.order if n.rng is not None and plan.mode(n) == "generator"]
    ran = kernels(lambda: materialize_module(m))
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(8), eager_next)
    random = lambda names: sorted(n for n in names if n in ("aten::uniform_", "aten::normal_"))  # noqa: E731
    assert dead and random(ran) == live and len(live) + len(dead) == len(random(eager_ran))


class OverwrittenGraph(nn.Module):
    """A buffer computed from a parameter with autograd, whose values a write
    under no_grad then replaces: eagerly it keeps the computation's grad_fn."""

    def __init__(self, how):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        b = torch.where(self.w > 0, self.w, self.w * 2)
        with torch.no_grad():
            if how == "fill_":
                b.fill_(1.5)
            else:
                b.copy_(torch.arange(4.0))
        self.register_buffer("b", b)


@pytest.mark.parametrize("how", ["fill_", "copy_"])
def test_overwritten_work_still_builds_eagers_autograd_graph(how):
    torch.manual_seed(0)
    eager = OverwrittenGraph(how)
    torch.manual_seed(0)
    d = materialize_module(deferred_init(OverwrittenGraph, how))
    assert_same_tensors(eager, d)
    assert type(d.b.grad_fn) is type(eager.b.grad_fn) and d.b.grad_fn is not None
    d.b.sum().backward()
    eager.b.sum().backward()
    assert torch.equal(d.w.grad, eager.w.grad)


class ComputedAndAliased(nn.Module):
    """A buffer computed from a parameter with autograd, and a parameter
    sharing its memory (found by the fuzzer in mixed order)."""

    def __init__(self, how):
        super().__init__()
        self.w = nn.Parameter(torch.empty(3))
        nn.init.uniform_(self.w, -0.5, 0.5)
        b = {"bernoulli": lambda: torch.bernoulli(self.w.sigmoid()), "mul": lambda: self.w * 2,
             "cumsum": lambda: self.w.cumsum(0)}[how]()
        self.register_buffer("b", b)
        self.alias = nn.Parameter(b, requires_grad=False)


@pytest.mark.parametrize("how", ["mul", "bernoulli", "cumsum"])
def test_a_computed_tensor_after_an_alias_of_it(how):
    """Materialized after its alias, the buffer's memory is real: its computation
    is replayed afresh for eager's graph, and the result takes the real memory
    (found by the fuzzer in mixed order; refused before). Every order gives
    eager's tensors, graph and gradients, the buffer sharing the alias's memory."""
    from deferinit.materialize.autograd import graph_leaves

    torch.manual_seed(0)
    eager = ComputedAndAliased(how)
    if how != "bernoulli":
        eager.b.sum().backward(retain_graph=True)
    for order in (["alias"], ["alias", "b"], ["b"], []):
        torch.manual_seed(0)
        d = deferred_init(ComputedAndAliased, how)
        for name in order:
            materialize_tensor(getattr(d, name))
        materialize_module(d)
        assert_same_tensors(eager, d)
        assert type(d.b.grad_fn) is type(eager.b.grad_fn)
        assert [x is d.w for x in graph_leaves(d.b)] == [True]
        assert d.b.untyped_storage().data_ptr() == d.alias.untyped_storage().data_ptr()
        if how != "bernoulli":
            d.b.sum().backward()
            assert torch.equal(d.w.grad, eager.w.grad)


class ViewOfComputedAndAliased(nn.Module):
    """A view of a tensor computed from a parameter, and a parameter sharing its memory."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(3))
        self.register_buffer("y", (self.w * 2)[1:])
        self.alias = nn.Parameter(self.y, requires_grad=False)


def test_a_view_of_a_computed_tensor_after_an_alias_of_it_is_refused():
    """Materialized after its alias, the view's memory is real, and the computed
    tensor it views is not replayed afresh for its graph: refused, nothing
    changed; the view first, or one call, gives eager's tensors and graph."""
    from deferinit import AutogradMaterializationError, is_deferred

    torch.manual_seed(0)
    eager = ViewOfComputedAndAliased()
    torch.manual_seed(0)
    d = deferred_init(ViewOfComputedAndAliased)
    materialize_tensor(d.alias)
    with pytest.raises(AutogradMaterializationError, match="sharing its memory"):
        materialize_module(d)
    assert is_deferred(d.y) and is_deferred(d.w)
    for order in (["y"], []):
        torch.manual_seed(0)
        d = deferred_init(ViewOfComputedAndAliased)
        for name in order:
            materialize_tensor(getattr(d, name))
        materialize_module(d)
        assert_same_tensors(eager, d)
        assert type(d.y.grad_fn) is type(eager.y.grad_fn)
        assert d.y.untyped_storage().data_ptr() == d.alias.untyped_storage().data_ptr()


def test_a_loaded_parameters_plan_does_not_walk_the_draws_before_it():
    # Each parameter's load hides its own draw, so its plan needs no generator
    # state: planning it must not take in every earlier parameter's draw (one
    # load per parameter, planned one at a time as sharded models are, was
    # quadratic in the number of parameters).
    torch.manual_seed(0)
    m = deferred_init(lambda: nn.Sequential(*[nn.Linear(4, 4) for _ in range(20)]))
    m.load_state_dict({k: torch.full(v.shape, 0.5) for k, v in m.state_dict().items()})
    plan = Plan([read_of(m[19].weight)])
    assert len(plan.liveness.universe) < 10
    assert not any(n.rng is not None for n in plan.order)
    materialize_module(m)
    assert all(torch.equal(t, torch.full_like(t, 0.5)) for t in m.state_dict().values())


_CONSTANTS = {
    "zeros": lambda src: torch.zeros(N, N),
    "new_zeros": lambda src: src.new_zeros(N, N),  # FSDP2's padded shard
    "ones_like": lambda src: torch.ones_like(torch.empty(N, N)),
    "full": lambda src: torch.full((N, N), 2.5),
    "new_full": lambda src: src.new_full((N, N), -1.0),
    "full int64": lambda src: torch.full((N, N), 7, dtype=torch.int64),
}


@pytest.mark.parametrize("make", list(_CONSTANTS))
def test_a_constant_factory_mostly_overwritten_is_filled_only_where_read(make):
    # FSDP2 pads a shard with new_zeros, then copies the shard's rows in:
    # eagerly the whole padded tensor is zeroed; only the padding is read.
    def build():
        def body(self):
            src = torch.randn(N - 1, N)
            t = _CONSTANTS[make](src)
            with torch.no_grad():
                t.narrow(0, 0, N - 1).copy_(src.to(t.dtype))
            self.register_buffer("a", t)

        return Holder(body)

    eager, eager_after, _ = eager_and_kernels(build)
    torch.manual_seed(0)
    m = deferred_init(build)
    check_jump_models()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        materialize_module(m)
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(8), eager_after)
    filled = [e.input_shapes[0] for e in prof.events() if e.name in ("aten::fill_", "aten::zero_")]
    assert filled == [[N]], filled  # the last row only, not N * N elements


def test_a_constant_factory_read_at_both_ends_equals_eager():
    # Rows 0 and N - 1 are read: the hull of what is read is all of it, so
    # the factory runs whole (no part to fill).
    def build():
        def body(self):
            t = torch.zeros(N, N)
            with torch.no_grad():
                t[1:-1].copy_(torch.randn(N - 2, N))
            self.register_buffer("a", t)

        return Holder(body)

    eager, eager_after, _ = eager_and_kernels(build)
    m, after, ran = deferred_and_kernels(build)
    assert_same_tensors(eager, m)
    assert torch.equal(after, eager_after)
