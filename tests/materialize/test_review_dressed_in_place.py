"""Review of the in-place dress (``swap.dress_fresh``: a replay's own factory
output becomes the Parameter itself) and of what came with it (holdings'
order, whole plans asked out of recorded order, hooks following the swap):
models of factory calls, against eager torch, where the replay's output,
the user's objects or the hooks could be shared or changed."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init, is_deferred
from deferinit.materialize import materialize_module, materialize_tensor
from deferinit.materialize.swap import Swaps


def _held(m):
    return dict(m.named_parameters(remove_duplicate=False), **dict(m.named_buffers(remove_duplicate=False)))


def _same(a, b, name):
    assert type(a) is type(b), (name, type(a), type(b))
    assert (a.dtype, a.shape, a.stride(), a.requires_grad, a.is_leaf) == (
        b.dtype, b.shape, b.stride(), b.requires_grad, b.is_leaf), name
    x, y = a.detach(), b.detach()
    if x.is_complex():
        x, y = torch.view_as_real(x), torch.view_as_real(y)
    assert torch.equal(x.float(), y.float()), name


def _order(d, order):
    if order == "module":
        materialize_module(d)
    else:
        for t in reversed(list(_held(d).values())):
            if is_deferred(t):
                materialize_tensor(t)
        materialize_module(d)


# -- classes, dtypes and the user's attributes -----------------------------------


class WithTag(nn.Parameter):
    def __new__(cls, data=None, requires_grad=True, tag="x"):
        obj = super().__new__(cls, data, requires_grad)
        obj.tag = tag
        return obj


class OwnFunction(nn.Parameter):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


class Kinds(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = WithTag(torch.randn(3), tag="hello")
        self.b = OwnFunction(torch.randn(3))
        self.c = WithTag(torch.randint(0, 5, (3,)), requires_grad=False)
        self.d = nn.Parameter(torch.randn(2))
        self.d.note = "kept"
        self.d.scale = torch.ones(2)
        self.e = nn.Buffer(torch.rand(2))
        self.f = nn.Parameter(torch.randn(2, dtype=torch.complex64))
        self.g = nn.Parameter(torch.ones(3, dtype=torch.bool), requires_grad=False)
        self.h = nn.Parameter(torch.randn(3), requires_grad=False)
        self.register_buffer("i", torch.randn(2, requires_grad=True))
        self.j = nn.Parameter(torch.zeros(3, dtype=torch.float8_e4m3fn))
        self.l = nn.Parameter(torch.tensor(2.5))
        self.m = nn.Parameter(torch.arange(5), requires_grad=False)


@pytest.mark.parametrize("order", ["module", "reverse"])
def test_classes_dtypes_and_attributes_as_eagerly(order):
    torch.manual_seed(0)
    eager = Kinds()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    d = deferred_init(Kinds)
    _order(d, order)
    a, b = _held(eager), _held(d)
    assert a.keys() == b.keys()
    for n in a:
        _same(a[n], b[n], n)
    assert d.a.tag == "hello" and d.d.note == "kept" and torch.equal(d.d.scale, eager.d.scale)
    assert type(d.b.add(1)) is type(eager.b.add(1))
    assert torch.equal(torch.get_rng_state(), after)


# -- hooks registered while deferred ------------------------------------------------


def _hooked(calls):
    class H(nn.Module):
        def __init__(self):
            super().__init__()
            for n in "abcd":
                p = nn.Parameter(torch.randn(2))
                setattr(self, n, p)
                p.register_hook(lambda g, n=n: calls.append(("hook", n)) or g * 3)
                p.register_post_accumulate_grad_hook(lambda t, n=n: calls.append(("acc", n, t.grad.tolist())))
    return H


def _backward(m, calls):
    calls.clear()
    (m.a * 1 + m.b * 2 + m.c * 3 + m.d * 4).sum().backward()
    return sorted(calls, key=repr), [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("k", [0, 2, None])
@pytest.mark.parametrize("what", [RuntimeError, KeyboardInterrupt])
def test_hooks_after_a_failed_then_a_good_materialization(k, what, monkeypatch):
    """The hooks of ``register_hook`` and ``register_post_accumulate_grad_hook``,
    registered on the fakes, run on the real tensors as eagerly, also after a
    materialization that failed at its ``k``-th streamed swap was undone."""
    calls: list = []
    torch.manual_seed(0)
    eager = _hooked(calls)()
    e_calls, e_grads = _backward(eager, calls)
    torch.manual_seed(0)
    d = deferred_init(_hooked(calls))
    if k is not None:
        one, n = Swaps.one, []

        def failing(self, *a):
            n.append(1)
            if len(n) == k + 1:
                raise what("boom")
            return one(self, *a)

        monkeypatch.setattr(Swaps, "one", failing)
        with pytest.raises(BaseException):
            materialize_module(d)
        assert all(is_deferred(p) for p in d.parameters())
        monkeypatch.setattr(Swaps, "one", one)
    materialize_module(d)
    d_calls, d_grads = _backward(d, calls)
    assert d_calls == e_calls
    assert all(torch.equal(x, y) for x, y in zip(e_grads, d_grads))
    assert all(torch.equal(x, y) for x, y in zip(eager.parameters(), d.parameters()))


# -- what the user holds ----------------------------------------------------------

OUT: list = []


class Outside(nn.Module):
    """Fakes the user keeps outside the module share memory with its parameters."""

    def __init__(self):
        super().__init__()
        x = torch.randn(4)
        OUT.append(x)
        self.p = nn.Parameter(x)
        y = torch.rand(3)
        OUT.append(y)
        self.register_buffer("b", y)
        self.q = nn.Parameter(torch.randn(2))
        OUT.append(self.q)


@pytest.mark.parametrize("order", ["module_first", "outside_first"])
def test_fakes_held_outside_the_module(order):
    OUT.clear()
    torch.manual_seed(0)
    eager = Outside()
    e_out = OUT[:]
    OUT.clear()
    torch.manual_seed(0)
    d = deferred_init(Outside)
    d_out = OUT[:]
    if order == "module_first":
        materialize_module(d)
    for t in d_out:
        if is_deferred(t):
            materialize_tensor(t)
    materialize_module(d)
    for x, y in zip(e_out, d_out):
        _same(x, y, "outside")
    assert d.p.data_ptr() == d_out[0].data_ptr() and d.b is d_out[1] and d.q is d_out[2]
    assert type(d_out[0]) is torch.Tensor and not d_out[0].requires_grad
    for n in ("p", "b", "q"):
        _same(getattr(eager, n), getattr(d, n), n)


@pytest.mark.parametrize("how", ["out", "detach", "view_as", "nn_init", "requires_grad_", "clone", "data"])
def test_real_tensors_the_constructor_was_given_stay_theirs(how):
    """A factory fed a real tensor of the user's: that tensor keeps its class,
    ``requires_grad`` and values as eagerly (it is not dressed in place)."""
    def make(o, o2):
        f = {
            "out": lambda t: torch.randn(3, out=t), "detach": lambda t: t.detach(),
            "view_as": lambda t: t.view_as(t), "nn_init": nn.init.normal_,
            "requires_grad_": lambda t: t.requires_grad_(False), "clone": lambda t: t.clone(), "data": None,
        }[how]
        m = nn.Module()
        if how == "data":  # the parameter's value is the user's tensor itself (an "external" node)
            m.p = nn.Parameter(torch.empty(3))
            m.p.data = o
            m.register_buffer("b", torch.empty(3, requires_grad=True))
            m.b.data = o2
            return m
        m.p = nn.Parameter(f(o))
        m.register_buffer("b", f(o2))
        return m

    torch.manual_seed(0)
    eo = (torch.arange(3.0), torch.arange(3.0))
    eager = make(*eo)
    torch.manual_seed(0)
    do = (torch.arange(3.0), torch.arange(3.0))
    d = deferred_init(make, *do)
    materialize_module(d)
    for n in ("p", "b"):
        _same(getattr(eager, n), getattr(d, n), n)
    for x, y in zip(eo, do):
        _same(x, y, "given")
    assert (d.b is do[1]) == (eager.b is eo[1])
    assert (d.p.data_ptr() == do[0].data_ptr()) == (eager.p.data_ptr() == eo[0].data_ptr())


# -- tensors carried by parameters, tied with buffers -----------------------------


class Carried(nn.Parameter):
    def __new__(cls, data=None, requires_grad=False, state=None):
        obj = super().__new__(cls, data, requires_grad)
        obj.state = state if state is not None else types.SimpleNamespace(absmax=torch.rand(2), code=torch.linspace(0, 1, 4))
        obj.scale = torch.randn(1)
        return obj


class CarriedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Carried(torch.randint(0, 9, (4,), dtype=torch.uint8))
        shared = types.SimpleNamespace(absmax=torch.rand(2), code=torch.linspace(0, 1, 4))
        self.b = Carried(torch.randint(0, 9, (4,), dtype=torch.uint8), state=shared)
        self.c = Carried(torch.randint(0, 9, (4,), dtype=torch.uint8), state=shared)
        self.register_buffer("am", self.a.state.absmax)
        self.extra = self.c.scale


def _carried(m):
    return {"a": m.a, "b": m.b, "c": m.c, "a.absmax": m.a.state.absmax, "a.code": m.a.state.code,
            "a.scale": m.a.scale, "b.absmax": m.b.state.absmax, "c.absmax": m.c.state.absmax,
            "c.scale": m.c.scale, "am": m.am, "extra": m.extra}


@pytest.mark.parametrize("order", ["module", "reverse", "buffer_first", "some_first"])
def test_carried_and_tied_tensors(order):
    torch.manual_seed(0)
    eager = CarriedModel()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    d = deferred_init(CarriedModel)
    if order == "module":
        materialize_module(d)
    elif order == "reverse":
        for t in reversed(list(_carried(d).values())):
            if is_deferred(t):
                materialize_tensor(t)
    elif order == "buffer_first":
        materialize_tensor(d.am)
        materialize_module(d)
    else:
        materialize_tensor(d.c.scale)
        materialize_tensor(d.b)
        materialize_module(d)
    te, td = _carried(eager), _carried(d)
    for n in te:
        _same(te[n], td[n], n)
    for n1 in te:
        for n2 in te:
            assert (te[n1] is te[n2]) == (td[n1] is td[n2]), (n1, n2)
    assert torch.equal(torch.get_rng_state(), after)


# -- whole plans out of recorded order -------------------------------------------


class Reordered(nn.Module):
    """Registered in another order than created, on two generators."""

    def __init__(self):
        super().__init__()
        a, b, c = torch.randn(3), torch.randn(3), torch.rand(2)
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(2, generator=g), torch.randn(2, generator=g)
        self.c, self.y, self.a, self.x, self.b = (nn.Parameter(t) for t in (c, y, a, x, b))


class Mixed(nn.Module):
    def __init__(self, device, seed_inside):
        super().__init__()
        self.x = nn.Parameter(torch.randn(3, device=device))
        self.y = nn.Parameter(torch.randn(2, device="cpu"))
        if seed_inside:
            torch.manual_seed(3)
        self.w = nn.Parameter(torch.rand(3, device=device))


@pytest.mark.parametrize("order", ["module", "reverse", "forward"])
def test_registered_out_of_created_order(order):
    torch.manual_seed(0)
    eager = Reordered()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    d = deferred_init(Reordered)
    ts = list(_held(d).values())
    if order == "module":
        materialize_module(d)
    else:
        for t in (reversed(ts) if order == "reverse" else ts):
            materialize_tensor(t)
    for n, t in _held(eager).items():
        _same(t, _held(d)[n], n)
    assert torch.equal(torch.get_rng_state(), after)


@pytest.mark.parametrize("perm", [(0, 1, 2), (2, 0, 1), (1, 2, 0), (2, 1, 0)])
def test_two_device_streams_merged_by_submodule(perm):
    """Recorded on (fake) cuda and cpu, made on the CPU submodule by submodule
    in any order: the CPU generator draws them all in recorded order."""
    def make(device):
        return nn.ModuleList([Mixed(device, i == 1) for i in range(3)])

    torch.manual_seed(0)
    eager = make("cpu")
    after = torch.get_rng_state()
    torch.manual_seed(0)
    d = deferred_init(make, "cuda")
    for i in perm:
        materialize_module(d[i], device="cpu")
    for n, t in _held(eager).items():
        _same(t, _held(d)[n], n)
    assert torch.equal(torch.get_rng_state(), after)
