"""nn.init.normal_, uniform_, constant_ and kaiming_uniform_ are recorded without their torch-function
round trip (deferinit.fastpath._init): every argument form eager accepts gives
eager's values and generator, the same graph as the general path, and what
the fast path does not take goes the general way."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

from torch.utils._python_dispatch import TorchDispatchMode

from deferinit import deferred_init, fastpath, graph_of
from helpers import check_exact

G = torch.Generator().manual_seed(7)

CALLS = {
    "normal_ defaults": lambda t: nn.init.normal_(t),
    "normal_ positional": lambda t: nn.init.normal_(t, 0.5, 0.02),
    "normal_ keywords": lambda t: nn.init.normal_(t, std=0.1, mean=-1.0),
    "normal_ int arguments": lambda t: nn.init.normal_(t, 1, 2),
    "normal_ generator": lambda t: nn.init.normal_(t, 0.0, 0.3, generator=G),
    "normal_ tensor std": lambda t: nn.init.normal_(t, 0.0, torch.tensor(0.5).item()),
    "uniform_ defaults": lambda t: nn.init.uniform_(t),
    "uniform_ bounds": lambda t: nn.init.uniform_(t, -0.25, b=0.75),
    "uniform_ generator": lambda t: nn.init.uniform_(t, generator=G),
    "constant_": lambda t: nn.init.constant_(t, 0.125),
    "constant_ int": lambda t: nn.init.constant_(t, 3),
    "constant_ bool": lambda t: nn.init.constant_(t, True),
    "kaiming_uniform_ defaults": lambda t: nn.init.kaiming_uniform_(t),
    "kaiming_uniform_ linear's": lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "kaiming_uniform_ fan_out relu": lambda t: nn.init.kaiming_uniform_(t, 0, "fan_out", "relu"),
    "kaiming_uniform_ tanh generator": lambda t: nn.init.kaiming_uniform_(t, nonlinearity="tanh", generator=G),
    "kaiming_uniform_ int a": lambda t: nn.init.kaiming_uniform_(t, a=2, mode="fan_in"),
    "kaiming_uniform_ selu": lambda t: nn.init.kaiming_uniform_(t, nonlinearity="selu"),
}


class Initialized(nn.Module):
    def __init__(self, call, dtype):
        super().__init__()
        G.manual_seed(7)
        self.weight = nn.Parameter(torch.empty(5, 3, dtype=dtype))
        self.register_buffer("table", torch.empty(4, 2, dtype=dtype))
        self.view_source = nn.Parameter(torch.zeros(6, 4, dtype=dtype))
        call(self.weight)
        call(self.table)
        call(self.view_source[1:, ::2])  # a view of a parameter: the general path
        self.after = nn.Linear(3, 2)  # the generator stream goes on after the fills


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_nn_init_fills_equal_eager(call, dtype):
    check_exact(Initialized, CALLS[call], dtype)


@pytest.mark.parametrize("call", sorted(CALLS))
def test_the_fast_path_records_the_general_paths_graph(call, monkeypatch):
    def graph():
        torch.manual_seed(0)
        m = deferred_init(Initialized, CALLS[call], torch.float32)
        return str(graph_of(m))

    fast = graph()
    for f in (nn.init.normal_, nn.init.uniform_, nn.init.constant_, nn.init.kaiming_uniform_):
        monkeypatch.delitem(fastpath.FAST, f)
        monkeypatch.delitem(fastpath.FAST, f.__code__)
    assert "uniform_" in fast or "normal_" in fast or "fill_" in fast
    assert fast == graph()


class Conv(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape))
        nn.init.kaiming_uniform_(self.weight, a=1.0)
        self.after = nn.Linear(2, 2)


@pytest.mark.parametrize("shape", [(4, 3, 3, 3), (8, 2, 5), (3, 1), (1, 7)])
def test_kaiming_uniform_of_any_rank_equals_eager(shape):
    check_exact(Conv, shape)


def test_kaiming_uniform_of_zero_elements_warns_as_eagerly():
    for build in (lambda: nn.init.kaiming_uniform_(torch.empty(0, 3)), lambda: deferred_init(nn.init.kaiming_uniform_, torch.empty(0, 3))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            build()
        assert [str(w.message) for w in caught] == ["Initializing zero-element tensors is a no-op"]


def test_what_eager_refuses_is_refused_with_eagers_error():
    for call, error in [
        (lambda: nn.init.kaiming_uniform_(torch.empty(3)), ValueError),
        (lambda: nn.init.kaiming_uniform_(torch.empty(3, 2), mode="fan_sideways"), ValueError),
        (lambda: nn.init.kaiming_uniform_(torch.empty(3, 2), nonlinearity="wiggle"), ValueError),
        (lambda: nn.init.uniform_(torch.empty(3, dtype=torch.half), -1e6, 1e6), RuntimeError),
        (lambda: nn.init.normal_(torch.empty(3), 0.0, -1.0), RuntimeError),
        (lambda: nn.init.normal_(torch.empty(3).expand(2, 3)), RuntimeError),
        (lambda: nn.init.constant_(torch.empty(3), "x"), TypeError),
    ]:
        with pytest.raises(error) as eager:
            call()
        with pytest.raises(error) as deferred:
            deferred_init(call)
        assert str(eager.value).split("\n")[0] in str(deferred.value)


def test_a_leaf_that_requires_grad_is_filled_under_no_grad_as_eagerly():
    def build():
        p = nn.Parameter(torch.empty(4))
        nn.init.normal_(p)
        assert torch.is_grad_enabled()  # restored after the fill
        return p

    torch.manual_seed(3)
    eager = build()
    torch.manual_seed(3)
    p = deferred_init(build)
    from deferinit.materialize import materialize_tensor

    assert torch.equal(materialize_tensor(p), eager) and p.requires_grad


class UnderGuard(nn.Module):
    """Layers built while transformers' guards stand for torch.nn.init's
    functions, as they do while a transformers model initializes its weights
    (FalconMamba and Dac rebuild their layers there)."""

    def __init__(self):
        super().__init__()
        from transformers.initialization import guard_torch_init_functions

        with guard_torch_init_functions():
            self.linear = nn.Linear(5, 3)
            self.conv = nn.Conv1d(2, 4, 3)
            nn.init.kaiming_uniform_(self.linear.weight, a=0.5, mode="fan_out")


def test_kaiming_uniform_under_transformers_guards_equals_eager():
    pytest.importorskip("transformers")
    check_exact(UnderGuard)


def _shifted_uniform(tensor, a=0.0, b=1.0, generator=None):
    return _ORIGINAL_UNIFORM(tensor, a - 1.0, b + 1.0, generator)


_ORIGINAL_UNIFORM = nn.init.uniform_


class UniformSwapped(nn.Module):
    """A library's wrapper named torch.nn.init.uniform_ that changes the bounds:
    eager's kaiming_uniform_ fills with tensor.uniform_, so the wrapper changes
    only the direct nn.init.uniform_ call."""

    def __init__(self):
        super().__init__()
        nn.init.uniform_ = _shifted_uniform
        try:
            self.linear = nn.Linear(4, 3)
            self.table = nn.Parameter(torch.empty(2, 3))
            nn.init.uniform_(self.table, -0.5, 0.5)
        finally:
            nn.init.uniform_ = _ORIGINAL_UNIFORM


def test_a_wrapper_in_place_of_nn_init_uniform_changes_what_it_changes_eagerly():
    check_exact(UniformSwapped)


def _doubling_normal(tensor, mean=0.0, std=1.0, generator=None):
    return _ORIGINAL_NORMAL(tensor, mean=mean + 1.0, std=std * 2.0, generator=generator)


_ORIGINAL_NORMAL = nn.init.normal_


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class NormalSwapped(nn.Module):
    """A wrapper named torch.nn.init.normal_ that changes mean and std, called
    where the fast path does not answer: under another dispatch mode, on a
    real tensor, with a tensor-valued std.  The prologue of the function it
    wraps hands the call over under the wrapper's name; running that name
    again would apply the wrapper twice."""

    def __init__(self, real):
        super().__init__()
        nn.init.normal_ = _doubling_normal
        try:
            self.weight = nn.Parameter(torch.empty(3, 4))
            with _Passthrough():
                nn.init.normal_(self.weight, 0.5, 0.1)
            nn.init.normal_(real, 0.0, 1.0)
            self.register_buffer("copied", real.clone())
            self.table = nn.Parameter(torch.empty(2, 3))
            nn.init.normal_(self.table, 0.0, torch.tensor(0.25))
        finally:
            nn.init.normal_ = _ORIGINAL_NORMAL


def test_a_wrapper_in_place_of_nn_init_normal_applies_once_where_the_general_path_runs():
    check_exact(NormalSwapped, torch.zeros(5))
