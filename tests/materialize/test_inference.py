"""Inference materialization gives true inference tensors, with the facts eager
construction under ``torch.inference_mode()`` gives (the contract of the
InferenceMode RFC): ``is_inference()``, no version counter, read-only outside
inference mode, ``requires_grad`` as eager.  A module deferred under an
ambient inference mode (or ``no_grad``) comes back as eager built it there."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from helpers import named_tensors
from deferinit.materialize import materialize_module, materialize_tensor


def facts(t):
    """What eager fixes about a tensor, without changing it."""
    out = {
        "class": type(t),
        "is_inference": t.is_inference(),
        "requires_grad": t.requires_grad,
        "is_leaf": t.is_leaf,
        "grad_fn": type(t.grad_fn).__name__,
    }
    try:
        t._version
        out["version counter"] = True
    except RuntimeError:
        out["version counter"] = False
    return out


def writable_outside_inference_mode(t) -> bool:
    try:
        with torch.no_grad():
            t.add_(0)
        return True
    except RuntimeError:
        return False


def held(module):
    """Parameters, buffers and plain tensor attributes by name."""
    out = dict(named_tensors(module))
    for name, sub in module.named_modules():
        for key, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}" if name else key] = value
    return out


class WithComputed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.register_buffer("scaled", self.lin.weight * 2)
        self.row = self.lin.weight[0]
        self.table = torch.arange(4.0)


MODULES = {
    "Linear": lambda: nn.Linear(3, 4),
    "BatchNorm1d": lambda: nn.BatchNorm1d(4),
    "Embedding": lambda: nn.Embedding(5, 3, padding_idx=0),
    "LSTM": lambda: nn.LSTM(3, 4),
    "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16),
    "computed tensors": WithComputed,
}


def assert_same_facts(eager, m):
    a, b = held(eager), held(m)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].detach(), b[name].detach()), name
        assert facts(b[name]) == facts(a[name]), name
    for name in a:
        assert writable_outside_inference_mode(b[name]) == writable_outside_inference_mode(a[name]), name


@pytest.mark.parametrize("name", list(MODULES))
def test_inference_true_matches_eager_construction_in_inference_mode(name):
    torch.manual_seed(0)
    with torch.inference_mode():
        eager = MODULES[name]()
    torch.manual_seed(0)
    m = deferred_init(MODULES[name])
    materialize_module(m, inference=True)
    assert_same_facts(eager, m)


@pytest.mark.parametrize("name", ["Linear", "computed tensors"])
def test_materialize_tensor_inference(name):
    torch.manual_seed(0)
    with torch.inference_mode():
        eager = MODULES[name]()
    torch.manual_seed(0)
    m = deferred_init(MODULES[name])
    for t in list(held(m).values()):
        materialize_tensor(t, inference=True)
    assert_same_facts(eager, m)


@pytest.mark.parametrize("name", list(MODULES))
@pytest.mark.parametrize("where", ["outside", "inside"])
def test_deferred_under_ambient_inference_mode(name, where):
    """Recorded under inference_mode(): inference tensors, materialized outside it or inside."""
    torch.manual_seed(0)
    with torch.inference_mode():
        eager = MODULES[name]()
    torch.manual_seed(0)
    with torch.inference_mode():
        m = deferred_init(MODULES[name])
        if where == "inside":
            materialize_module(m)
    if where == "outside":
        materialize_module(m)
    assert_same_facts(eager, m)


@pytest.mark.parametrize("name", ["Linear", "computed tensors"])
def test_deferred_normally_materialized_inside_inference_mode(name):
    """Recorded outside inference mode: normal tensors, wherever materialized."""
    torch.manual_seed(0)
    eager = MODULES[name]()
    torch.manual_seed(0)
    m = deferred_init(MODULES[name])
    with torch.inference_mode():
        materialize_module(m)
    assert_same_facts(eager, m)


class Mixed(nn.Module):
    """Part of it built with inference mode switched off again inside."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        with torch.inference_mode(False):
            self.b = nn.Linear(2, 2)
            self.register_buffer("c", torch.ones(2))


def test_inference_mode_switched_off_inside_the_constructor():
    torch.manual_seed(0)
    with torch.inference_mode():
        eager = Mixed()
    torch.manual_seed(0)
    with torch.inference_mode():
        m = deferred_init(Mixed)
    materialize_module(m)
    assert_same_facts(eager, m)
    assert m.a.weight.is_inference() and not m.b.weight.is_inference()


@pytest.mark.parametrize("name", ["Linear", "computed tensors", "LSTM"])
def test_deferred_under_ambient_no_grad(name):
    torch.manual_seed(0)
    with torch.no_grad():
        eager = MODULES[name]()
    torch.manual_seed(0)
    with torch.no_grad():
        m = deferred_init(MODULES[name])
    materialize_module(m)
    assert_same_facts(eager, m)
