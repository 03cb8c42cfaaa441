"""Review of the streamed swap (``pipeline._streamed``, ``Replay._run_whole``,
``Swaps.one``), ``plan.draws_outside`` and ``flat``'s written rebuilds: models
of factory calls only, in unusual ways, against eager torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init, is_deferred
from deferinit.fake.flat import flatten, unflatten
from deferinit.materialize import materialize_module, materialize_tensor
from deferinit.materialize.swap import Swaps

G1 = torch.Generator()
G2 = torch.Generator()


def _seed():
    torch.manual_seed(0)
    G1.manual_seed(1)
    G2.manual_seed(2)


def _state():
    return torch.get_rng_state(), G1.get_state(), G2.get_state()


def _held(m):
    return dict(m.named_parameters(remove_duplicate=False), **dict(m.named_buffers(remove_duplicate=False)))


def _same(a, b, name, values=True):
    assert type(a) is type(b), (name, type(a), type(b))
    assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad, name
    if values:
        x, y = a.detach().cpu(), b.detach().cpu()
        if x.is_complex():
            x, y = torch.view_as_real(x), torch.view_as_real(y)
        assert torch.equal(x, y) or (x.is_floating_point() and torch.equal(x.nan_to_num(), y.nan_to_num())), name


def _compare(eager, d, skip=("em",)):
    a, b = _held(eager), _held(d)
    assert a.keys() == b.keys()
    for n in a:
        assert not is_deferred(b[n]), n
        _same(a[n], b[n], n, n not in skip)
    ia = {n: id(t) for n, t in a.items()}
    ib = {n: id(t) for n, t in b.items()}
    for n1 in a:
        for n2 in a:
            assert (ia[n1] == ia[n2]) == (ib[n1] == ib[n2]), (n1, n2)


def _after_equal(e_state):
    s = _state()
    for x, y in zip(e_state, s):
        assert torch.equal(x, y)


class Factories(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.full((3,), 2.5))
        self.register_buffer("ar", torch.arange(7))
        self.register_buffer("arf", torch.arange(0, 1, 0.125))
        self.register_buffer("eye", torch.eye(3, 4))
        self.register_buffer("ri", torch.randint(0, 10, (5,)))
        self.register_buffer("rp", torch.randperm(9))
        self.register_buffer("rpg", torch.randperm(70, generator=G1))
        self.b = nn.Parameter(torch.normal(0.0, 2.0, (4,)))
        self.c = nn.Parameter(torch.randn(3, generator=G1))
        self.d = nn.Parameter(torch.rand(3, generator=G2))
        self.e = nn.Parameter(torch.randn(3, generator=G1))
        self.f = nn.Parameter(torch.randn(2, dtype=torch.complex64))
        self.register_buffer("em", torch.empty(2, 3))  # never written: compared in shape only
        self.h = nn.Parameter(torch.randn(3, requires_grad=True))
        self.i = nn.Parameter(torch.randn(3), requires_grad=False)
        self.register_buffer("np", torch.randn(4), persistent=False)
        self.register_buffer("ri64", torch.randint(-5, 5, (3,), dtype=torch.int64, generator=G2))
        self.j = nn.Parameter(torch.randn(2, dtype=torch.float64))
        self.k = nn.Parameter(torch.randn(2, dtype=torch.bfloat16))
        self.l = nn.Parameter(torch.rand(5))


class Compared(Factories):
    """Not only factory calls: the pass over all."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bo", torch.rand(3) > 0.5)
        self.g = nn.Parameter(torch.randn(0, 3))


class DefaultDtype(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3))
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            self.b = nn.Parameter(torch.randn(3))
            self.c = nn.Parameter(torch.rand(3))
        finally:
            torch.set_default_dtype(old)
        self.d = nn.Parameter(torch.randn(3))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.x = nn.Linear(3, 3)
        self.y = nn.Linear(3, 3)
        self.y.weight = self.x.weight
        self.p = nn.Parameter(torch.randn(2))
        self.register_parameter("q", self.p)


class Events(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3))
        self.b = nn.Parameter(torch.randn(3))
        torch.manual_seed(5)
        self.c = nn.Parameter(torch.randn(3))
        st = G1.get_state()
        self.d = nn.Parameter(torch.randn(3, generator=G1))
        self.e = nn.Parameter(torch.randn(3, generator=G1))
        G1.set_state(st)
        self.f = nn.Parameter(torch.randn(3, generator=G1))
        with torch.random.fork_rng():
            self.g = nn.Parameter(torch.randn(3))
        self.h = nn.Parameter(torch.randn(3))
        self.i = nn.Parameter(torch.randn(3, generator=G1))


class ReSet(nn.Module):
    """The default generator's state is put back inside a run of draws."""

    def __init__(self):
        super().__init__()
        st = torch.get_rng_state()
        self.a = nn.Parameter(torch.randn(3))
        self.b = nn.Parameter(torch.randn(3))
        torch.set_rng_state(st)
        self.c = nn.Parameter(torch.randn(3))
        self.d = nn.Parameter(torch.randn(3))
        st2 = torch.get_rng_state()
        self.e = nn.Parameter(torch.randn(3))
        torch.set_rng_state(st2)
        self.f = nn.Parameter(torch.randn(3))


MODELS = [Factories, Compared, DefaultDtype, Tied, Events, ReSet]


def _build(cls, deferred):
    _seed()
    m = deferred_init(cls) if deferred else cls()
    return m, _state()


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("how", ["whole", "reverse", "submodules", "subset", "inference", "imode", "progress",
                                 "buffers"])
def test_models_against_eager(cls, how):
    eager, e_state = _build(cls, False)
    d, _ = _build(cls, True)
    if how == "whole":
        materialize_module(d)
    elif how == "progress":
        materialize_module(d, progress=True)
    elif how == "inference":
        materialize_module(d, inference=True)
    elif how == "imode":
        with torch.inference_mode():
            materialize_module(d)
    elif how == "buffers":
        materialize_module(d, buffers_only=True)
        assert all(not is_deferred(b) for b in d.buffers())
        materialize_module(d)
    elif how == "reverse":
        for n, t in reversed(list(_held(d).items())):
            if is_deferred(t):
                materialize_tensor(t)
    elif how == "submodules":
        for mod in reversed(list(d.modules())):
            materialize_module(mod)
    elif how == "subset":
        names = list(_held(d))
        for n in names[1::2]:
            if is_deferred(_held(d)[n]):
                materialize_tensor(_held(d)[n])
        materialize_module(d)
    if how in ("inference", "imode"):
        a, b = _held(eager), _held(d)
        for n in a:
            x, y = a[n].detach(), b[n].detach()
            assert x.dtype == y.dtype and (n == "em" or torch.equal(x, y) or torch.equal(x.nan_to_num(), y.nan_to_num())), n
    else:
        _compare(eager, d)
    # the generators afterwards: as after eager construction
    _after_equal(e_state)


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("k", [0, 1, 2, 5])
@pytest.mark.parametrize("what", ["one", "exit"])
def test_failure_at_kth_swap(cls, k, what, monkeypatch):
    eager, e_state = _build(cls, False)
    d, _ = _build(cls, True)
    torch.manual_seed(99)
    G1.manual_seed(98)
    before = _state()
    calls = []
    one = Swaps.one

    def failing(self, *a):
        calls.append(1)
        if len(calls) == k + 1:
            raise (KeyboardInterrupt if what == "exit" else RuntimeError)("boom")
        return one(self, *a)

    monkeypatch.setattr(Swaps, "one", failing)
    try:
        materialize_module(d)
    except BaseException:
        pass
    if len(calls) <= k:
        pytest.skip(f"only {len(calls)} streamed swaps")
    assert all(is_deferred(t) for t in _held(d).values())
    assert all(torch.equal(x, y) for x, y in zip(before, _state()))
    monkeypatch.setattr(Swaps, "one", one)
    materialize_module(d)
    _compare(eager, d)


@pytest.mark.parametrize("order", ["module", "reverse"])
def test_fake_cuda_to_cpu(order):
    """Recorded on (fake) cuda, made on the CPU: the CPU generator draws them in
    recorded order, as the same model built eagerly on the CPU."""

    class M(nn.Module):
        def __init__(self, device):
            super().__init__()
            self.a = nn.Parameter(torch.randn(3, device=device))
            self.b = nn.Parameter(torch.randn(3, device=device))
            self.c = nn.Parameter(torch.full((2,), 3.0, device=device))
            self.d = nn.Parameter(torch.rand(3, device=device))

    torch.manual_seed(0)
    eager = M("cpu")
    after = torch.get_rng_state()
    torch.manual_seed(0)
    d = deferred_init(M, "cuda")
    if order == "module":
        materialize_module(d, device="cpu")
    else:
        for t in reversed(list(_held(d).values())):
            materialize_tensor(t, device="cpu")
    _compare(eager, d)
    assert torch.equal(torch.get_rng_state(), after)
    assert d.a.device.type == "cpu"


class CpuStateRestored(nn.Module):
    """Draws on ``device``; only the CPU generator's state is saved and put back
    (``torch.get_rng_state``/``set_rng_state``, or ``fork_rng(devices=[])``)."""

    def __init__(self, device, how):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3, device=device))
        if how == "fork":
            with torch.random.fork_rng(devices=[]):
                self.b = nn.Parameter(torch.rand(2, device=device))
        else:
            st = torch.get_rng_state()
            self.b = nn.Parameter(torch.rand(2, device=device if how == "state" else "cpu"))
            torch.set_rng_state(st)
        self.c = nn.Parameter(torch.rand(3, device=device))


@pytest.mark.xfail(strict=True, reason=(
    "pre-existing (f11efa4 too, streamed or not): recorded for (fake) cuda and made on the CPU, "
    "a CPU state put back after a cuda draw is the CPU record stream's state (before that draw), "
    "not the merged generator's: c differs from eager CPU construction, and so does the CPU "
    "generator afterwards (docs/guide.md promises eager construction on CPU)"))
@pytest.mark.parametrize("how", ["state", "state_cpu_draw", "fork"])
def test_fake_cuda_to_cpu_with_the_cpu_state_put_back(how):
    torch.manual_seed(0)
    eager = CpuStateRestored("cpu", how)
    after = torch.get_rng_state()
    torch.manual_seed(0)
    d = deferred_init(CpuStateRestored, "cuda", how)
    materialize_module(d, device="cpu")
    _compare(eager, d)
    assert torch.equal(torch.get_rng_state(), after)


def test_check_fn():
    eager, e_state = _build(Factories, False)
    d, _ = _build(Factories, True)
    materialize_module(d, check_fn=lambda m: True)
    _compare(eager, d)
    _after_equal(e_state)


def test_two_tensor_wrapping():
    from torch.testing._internal.two_tensor import TwoTensor

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(3))
            self.register_buffer("t", TwoTensor(torch.randn(3), torch.rand(3)))
            self.b = nn.Parameter(torch.randn(3))

    eager, e_state = _build(M, False)
    d, _ = _build(M, True)
    materialize_module(d)
    for n in ("a", "b"):
        _same(getattr(eager, n), getattr(d, n), n)
    assert type(d.t) is TwoTensor
    assert torch.equal(d.t.a, eager.t.a) and torch.equal(d.t.b, eager.t.b)
    _after_equal(e_state)


def test_lazy_module_left_alone():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(3, 2)
            self.z = nn.LazyLinear(4)
            self.p = nn.Parameter(torch.randn(2))

    eager, e_state = _build(M, False)
    d, _ = _build(M, True)
    materialize_module(d)
    for n in ("l.weight", "l.bias", "p"):
        _same(_held(eager)[n], _held(d)[n], n)
    _after_equal(e_state)


@pytest.mark.parametrize("args,kwargs", [
    ((), {}),
    ((1,), {}),
    (([],), {}),
    (((),), {}),
    (((1,),), {}),
    (([1],), {}),
    ((1, [2, 3], (4,), ()), {"a": [5], "b": (), "c": 6}),
    ((list(range(70)),), {}),
    ((list(range(64)),), {}),
    ((list(range(63)), 1), {"k": 2}),
    ((list(range(30)), tuple(range(40))), {}),
    ((), {"class": 1, "def": [2], "a-b": (3,), "x y": 4, "'": 5, '"\\': [6, 7]}),
    ((torch.Size([2, 3]),), {}),
    (([[1, 2], [3]],), {}),
    (((1, [2]),), {}),
])
def test_flat_roundtrip(args, kwargs):
    flat, spec = flatten(args, kwargs)
    a2, k2 = unflatten(list(flat), spec)
    assert type(a2) is tuple and len(a2) == len(args)
    for x, y in zip(args, a2):
        assert type(x) is type(y) and x == y
    assert list(k2) == list(kwargs)
    for key in kwargs:
        assert type(kwargs[key]) is type(k2[key]) and kwargs[key] == k2[key]
    # fresh containers each time (a replay may mutate its kwargs)
    a3, k3 = unflatten(list(flat), spec)
    assert k3 is not k2
    for x, y in zip(a2, a3):
        if isinstance(x, list):
            assert x is not y


@pytest.mark.parametrize("cls,streamed", [(Factories, True), (DefaultDtype, True), (Events, True), (ReSet, True)])
def test_streamed_counts(cls, streamed, monkeypatch):
    """The models above meant for the streamed path take it (else they test nothing new)."""
    calls = []
    one = Swaps.one
    monkeypatch.setattr(Swaps, "one", lambda self, *a: calls.append(1) or one(self, *a))
    d, _ = _build(cls, True)
    materialize_module(d)
    assert (len(calls) == len(_held(d))) == streamed


class Aliased(nn.Module):
    """Factory outputs held beyond the module's parameters and buffers too."""

    def __init__(self):
        super().__init__()
        t = torch.randn(4)
        self.p = nn.Parameter(t)
        self.raw = [t]  # the same storage, not registered
        self.w = nn.Parameter(torch.randn(4))
        self.cache = [self.w.detach().view(2, 2)]
        self.w._no_weight_decay = True
        self.q = nn.Parameter(torch.randn(3))
        self.q.requires_grad_(False)
        a = torch.rand(3)
        self.register_buffer("x", a)
        self.y = nn.Parameter(a)  # same storage as buffer x


def _ptrs(m):
    return {n: t.untyped_storage().data_ptr() for n, t in _held(m).items()}


@pytest.mark.parametrize("order", ["module", "reverse"])
def test_aliases_against_eager(order):
    eager, e_state = _build(Aliased, False)
    d, _ = _build(Aliased, True)
    if order == "module":
        materialize_module(d)
    else:
        for t in reversed(list(_held(d).values())):
            if is_deferred(t):
                materialize_tensor(t)
    _compare(eager, d)
    assert getattr(d.w, "_no_weight_decay", None) is True
    pe, pd = _ptrs(eager), _ptrs(d)
    for n1 in pe:
        for n2 in pe:
            assert (pe[n1] == pe[n2]) == (pd[n1] == pd[n2]), (n1, n2)
    raw = materialize_tensor(d.raw[0])
    cache = materialize_tensor(d.cache[0])
    assert torch.equal(raw, eager.raw[0]) and torch.equal(cache, eager.cache[0])
    # the same memory as eager's: a write through the parameter shows in the aliases
    with torch.no_grad():
        d.p.add_(1)
        d.w.add_(1)
        eager.p.add_(1)
        eager.w.add_(1)
    assert torch.equal(d.raw[0], eager.raw[0]) and torch.equal(d.cache[0], eager.cache[0])
    _after_equal(e_state)


class Holder(nn.Module):
    def __init__(self, t):
        super().__init__()
        self.t = nn.Parameter(t)


class EventSubsets(nn.Module):
    """Runs of draws with every kind of event among them, one tensor per submodule."""

    def __init__(self):
        super().__init__()
        hs = []
        hs.append(Holder(torch.randn(3)))
        st = torch.get_rng_state()
        hs.append(Holder(torch.randn(3)))
        hs.append(Holder(torch.randn(3, generator=G1)))
        torch.set_rng_state(st)
        hs.append(Holder(torch.randn(3)))
        gst = G1.get_state()
        hs.append(Holder(torch.randn(3, generator=G1)))
        hs.append(Holder(torch.randn(3)))
        G1.set_state(gst)
        hs.append(Holder(torch.randn(3, generator=G1)))
        torch.manual_seed(3)
        hs.append(Holder(torch.randn(3)))
        hs.append(Holder(torch.randn(3)))
        self.hs = nn.ModuleList(hs)


@pytest.mark.parametrize("mask", range(0, 512, 7))
def test_event_subsets(mask):
    eager, e_state = _build(EventSubsets, False)
    d, _ = _build(EventSubsets, True)
    chosen = {id(h) for i, h in enumerate(d.hs) if mask >> i & 1}
    materialize_module(d, check_fn=lambda m: id(m) in chosen)
    for i, h in enumerate(d.hs):
        assert is_deferred(h.t) != bool(mask >> i & 1), i
        if not is_deferred(h.t):
            assert torch.equal(h.t, eager.hs[i].t), i
    materialize_module(d)
    _compare(eager, d)
    _after_equal(e_state)


MEAN = torch.arange(4.0)
P = torch.full((5,), 0.5)
FILL = torch.tensor(2.5)


class RealArgs(nn.Module):
    """Factory calls given real tensors made outside (mean, probability, fill)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3))
        self.b = nn.Parameter(torch.normal(MEAN, 1.0))
        self.register_buffer("c", torch.bernoulli(P))
        self.d = nn.Parameter(torch.full((2,), FILL.item()))
        self.e = nn.Parameter(torch.normal(MEAN, torch.ones(4)))
        self.f = nn.Parameter(torch.randn(3))
        self.register_buffer("g", torch.multinomial(P, 3))
        self.h = nn.Parameter(torch.randn(3))


@pytest.mark.parametrize("mutate", [False, True])
@pytest.mark.parametrize("order", ["module", "reverse"])
def test_real_tensor_arguments(mutate, order):
    from deferinit.materialize.errors import ExternalTensorMutatedError

    eager, e_state = _build(RealArgs, False)
    d, _ = _build(RealArgs, True)

    def run():
        if order == "module":
            materialize_module(d)
        else:
            for t in reversed(list(_held(d).values())):
                materialize_tensor(t)

    if mutate:  # written after construction: a clear error, nothing changed
        MEAN.add_(100)
        before = _state()
        try:
            with pytest.raises(ExternalTensorMutatedError):
                run()
        finally:
            MEAN.sub_(100)
        assert all(torch.equal(x, y) for x, y in zip(before, _state()))
        if order == "module":
            assert all(is_deferred(t) for t in _held(d).values())
        pytest.skip("the outside tensor changed: not reproducible (a clear error)")
    run()
    _compare(eager, d)
    _after_equal(e_state)


@pytest.mark.parametrize("where", ["rebuilt", "one_object_each", "swap_in"])
@pytest.mark.parametrize("cls", [Factories, Events, Compared])
def test_failure_after_streaming(where, cls, monkeypatch):
    """A failure after the replay swapped tensors in: everything deferred again,
    generators as they were, and a second call gives eager's values."""
    import deferinit.materialize.pipeline as pipeline
    import deferinit.materialize.swap as swap_mod

    eager, e_state = _build(cls, False)
    d, _ = _build(cls, True)
    streamed = []
    one = Swaps.one
    monkeypatch.setattr(Swaps, "one", lambda self, *a: streamed.append(1) or one(self, *a))

    def boom(*a, **k):
        raise RuntimeError("boom")

    if where == "rebuilt":
        monkeypatch.setattr(swap_mod, "rebuilt", boom)
    elif where == "one_object_each":
        monkeypatch.setattr(pipeline, "_one_object_each", boom)
    elif where == "swap_in":
        monkeypatch.setattr(pipeline, "_swap_in", boom)
    else:
        monkeypatch.setattr(pipeline, "_swap_in", boom)
    before = _state()
    try:
        materialize_module(d)
    except Exception:
        pass
    else:
        pytest.skip("did not fail here")
    if not streamed:
        pytest.skip("nothing streamed")
    assert all(is_deferred(t) for t in _held(d).values())
    assert all(torch.equal(x, y) for x, y in zip(before, _state()))
    monkeypatch.undo()
    materialize_module(d)
    _compare(eager, d)
    _after_equal(e_state)


@pytest.mark.parametrize("ctx", ["dtype64", "meta_device", "cpu_device_fn", "deterministic"])
@pytest.mark.parametrize("cls", [Factories, DefaultDtype, Events])
def test_ambient_settings_at_materialization(ctx, cls):
    """Settings of the caller at materialization time do not leak into the
    replay: the values are those eager construction made."""
    eager, e_state = _build(cls, False)
    d, _ = _build(cls, True)
    old = torch.get_default_dtype()
    if ctx == "dtype64":
        torch.set_default_dtype(torch.float64)
        try:
            materialize_module(d)
        finally:
            torch.set_default_dtype(old)
    elif ctx == "meta_device":
        with torch.device("meta"):
            materialize_module(d)
    elif ctx == "cpu_device_fn":
        torch.set_default_device("cpu")
        try:
            materialize_module(d)
        finally:
            torch.set_default_device(None)
    else:
        torch.use_deterministic_algorithms(True)
        try:
            materialize_module(d)
        finally:
            torch.use_deterministic_algorithms(False)
    assert torch.get_default_dtype() is old
    _compare(eager, d)
    _after_equal(e_state)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3))
        self.b = nn.Parameter(torch.randn(3))
        self.c = nn.Parameter(torch.rand(2))
        self.d = nn.Parameter(torch.randn(3))


@pytest.mark.parametrize("order", ["together", "second_first", "interleaved", "reverse_tensors"])
@pytest.mark.parametrize("between", [None, "seed"])  # (a real draw between: documented as not eager)
def test_two_records(order, between):
    """Two deferred_init calls on the same generators, materialized in any order."""
    _seed()
    e1 = Small()
    if between == "draw":
        torch.randn(5)
    elif between == "seed":
        torch.manual_seed(4)
    e2 = Small()
    e_state = _state()
    _seed()
    d1 = deferred_init(Small)
    if between == "draw":
        torch.randn(5)
    elif between == "seed":
        torch.manual_seed(4)
    d2 = deferred_init(Small)
    if order == "together":
        materialize_module(nn.ModuleList([d1, d2]))
    elif order == "second_first":
        materialize_module(d2)
        materialize_module(d1)
    elif order == "interleaved":
        for n in "dacb":
            materialize_tensor(getattr(d2, n))
            materialize_tensor(getattr(d1, n))
    else:
        for t in reversed(list(_held(d1).values()) + list(_held(d2).values())):
            materialize_tensor(t)
    _compare(e1, d1)
    _compare(e2, d2)
    _after_equal(e_state)


@pytest.mark.xfail(strict=True, reason=(
    "pre-existing (deferinit/random/record.py, not this stop's code): an explicit generator's stream is "
    "not chained to the previous record's (CHAINS covers default generators only; close() gives the "
    "generator its pre-draw state back), so a second model deferred from the same explicit generator "
    "replays the first one's numbers, silently; docs/guide.md says models deferred one after the other "
    "continue one random stream and explicit generators are advanced the same way"))
@pytest.mark.parametrize("order", ["together", "first_first", "second_first"])
def test_two_records_on_an_explicit_generator(order):
    g = torch.Generator()

    def make():
        return nn.Parameter(torch.rand(2, generator=g))

    g.manual_seed(1)
    e1, e2 = make(), make()
    after = g.get_state()
    g.manual_seed(1)
    d1, d2 = deferred_init(make), deferred_init(make)
    if order == "together":
        materialize_module(nn.ParameterList([d1, d2]))
    elif order == "first_first":
        materialize_tensor(d1)
        materialize_tensor(d2)
    else:
        materialize_tensor(d2)
        materialize_tensor(d1)
    assert torch.equal(d1, e1)
    assert torch.equal(d2, e2), "the second model drew the first one's numbers"
    assert torch.equal(g.get_state(), after)


class PutBackAcrossSeed(nn.Module):
    """A run of target draws whose first follows a seed, and inside it a state
    from before the seed put back (after a temporary draw)."""

    def __init__(self, gen):
        super().__init__()
        kw = {} if gen is None else {"generator": gen}
        torch.randn(4, **kw)  # a temporary: nothing keeps it
        st = torch.get_rng_state() if gen is None else gen.get_state()
        if gen is None:
            torch.manual_seed(5)
        else:
            gen.manual_seed(5)
        self.a = nn.Parameter(torch.randn(3, **kw))
        if gen is None:
            torch.set_rng_state(st)
        else:
            gen.set_state(st)
        self.b = nn.Parameter(torch.randn(3, **kw))
        self.c = nn.Parameter(torch.randn(3, **kw))


@pytest.mark.parametrize("gen", [None, "G1"])
@pytest.mark.parametrize("order", ["module", "reverse", "b_only"])
def test_state_put_back_across_a_seed(gen, order):
    g = None if gen is None else G1
    _seed()
    eager = PutBackAcrossSeed(g)
    e_state = _state()
    _seed()
    d = deferred_init(PutBackAcrossSeed, g)
    if order == "module":
        materialize_module(d)
    elif order == "b_only":
        materialize_tensor(d.b)
        assert torch.equal(d.b, eager.b)
        materialize_module(d)
    else:
        for t in reversed(list(_held(d).values())):
            materialize_tensor(t)
    _compare(eager, d)
    _after_equal(e_state)


@pytest.mark.xfail(strict=True, reason=(
    "pre-existing (streamed or not): a .grad given to a parameter inside the constructor is "
    "silently dropped by materialization (None), where eager keeps it"))
@pytest.mark.parametrize("order", ["module", "tensor"])
def test_grad_set_in_the_constructor(order):
    def make():
        p = nn.Parameter(torch.randn(3))
        p.grad = torch.ones(3)
        return nn.ParameterList([p, nn.Parameter(torch.randn(2))])

    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    d = deferred_init(make)
    if order == "module":
        materialize_module(d)
    else:
        materialize_tensor(d[0])
    assert torch.equal(d[0], eager[0])
    assert d[0].grad is not None and torch.equal(d[0].grad, eager[0].grad)
