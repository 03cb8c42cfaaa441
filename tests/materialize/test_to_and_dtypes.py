"""``.to()`` in every form on deferred modules and tensors, inside constructors
and after them, and Python types as dtypes (issue 11: the ``.to()`` family,
items 12 and 20).  Each case is built eagerly and deferred under the same
seed and compared bit for bit after materialization."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init, is_deferred
from helpers import assert_same_tensors, check_exact, named_tensors
from deferinit.materialize import materialize_module, materialize_tensor

CPU = torch.device("cpu")
CUDA0 = torch.device("cuda", 0)


class ConvBNLin(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)  # an integer buffer: num_batches_tracked
        self.lin = nn.Linear(4, 2)


def _as_cpu(x):
    if isinstance(x, str) and x.startswith("cuda"):
        return "cpu"
    if isinstance(x, torch.device) and x.type == "cuda":
        return CPU
    return x


MODULE_FORMS = {
    "to('cpu')": (("cpu",), {}),
    "to('cuda')": (("cuda",), {}),
    "to('cuda:0')": (("cuda:0",), {}),
    "to(device('cpu'))": ((CPU,), {}),
    "to(device('cuda'))": ((torch.device("cuda"),), {}),
    "to(device='cuda')": ((), {"device": "cuda"}),
    "to(bfloat16)": ((torch.bfloat16,), {}),
    "to(dtype=float64)": ((), {"dtype": torch.float64}),
    "to('cuda', float16)": (("cuda", torch.float16), {}),
    "to('cpu', non_blocking=True)": (("cpu",), {"non_blocking": True}),
    "to(memory_format=channels_last)": ((), {"memory_format": torch.channels_last}),
    "to('cuda', memory_format=channels_last)": (("cuda",), {"memory_format": torch.channels_last}),
    "to(tensor float64)": ((torch.zeros(1, dtype=torch.float64),), {}),
}


@pytest.mark.parametrize("form", list(MODULE_FORMS))
def test_deferred_module_to(form):
    """deferred_module.to(...): the tensors stay deferred, report eager's device,
    dtype and strides, and materialize to eager's values."""
    args, kwargs = MODULE_FORMS[form]
    torch.manual_seed(0)
    eager = ConvBNLin().to(*map(_as_cpu, args), **{k: _as_cpu(v) for k, v in kwargs.items()})
    torch.manual_seed(0)
    d = deferred_init(ConvBNLin)
    assert d.to(*args, **kwargs) is d
    cuda = "cuda" in form
    for name, t in named_tensors(d).items():
        e = named_tensors(eager)[name]
        assert is_deferred(t) and t.device == (CUDA0 if cuda else CPU), name
        assert (t.dtype, t.stride()) == (e.dtype, e.stride()), name
    materialize_module(d, device="cpu" if cuda else None)
    assert_same_tensors(eager, d)


@pytest.mark.parametrize("method", ["half", "bfloat16", "double", "float"])
def test_dtype_methods_keep_integer_buffers(method):
    """Item 12: half()/bfloat16()/... leave num_batches_tracked an integer, as eagerly."""
    torch.manual_seed(0)
    eager = getattr(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), method)()
    torch.manual_seed(0)
    d = getattr(deferred_init(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))), method)()
    materialize_module(d)
    assert_same_tensors(eager, d)


class SelfTo(nn.Module):
    """A constructor that moves itself (inside deferred_init)."""

    def __init__(self, args, kwargs):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.to(*args, **kwargs)


@pytest.mark.parametrize("args, kwargs", [
    (("cpu",), {}), ((CPU,), {}), ((), {"device": "cpu"}), ((torch.float64,), {}),
    (("cpu", torch.float64), {}), ((torch.bfloat16,), {}), ((), {"dtype": torch.float16, "non_blocking": True}),
], ids=str)
def test_self_to_inside_constructor(args, kwargs):
    check_exact(SelfTo, args, kwargs)


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda"), "cuda:0", {"device": "cuda"}], ids=str)
def test_self_to_cuda_inside_constructor(device):
    args, kwargs = ((), device) if isinstance(device, dict) else ((device,), {})
    torch.manual_seed(0)
    eager = SelfTo(("cpu",), {})
    torch.manual_seed(0)
    d = deferred_init(SelfTo, args, kwargs)
    assert d.lin.weight.device == CUDA0 and d.bn.num_batches_tracked.device == CUDA0
    materialize_module(d, device="cpu")
    assert_same_tensors(eager, d)


TENSOR_FORMS = [
    (("cpu", torch.float16, False, True), {}), ((torch.float16, False, True), {}),
    ((None, torch.float16, False), {}), ((None, None, False), {}), (("cpu", None), {}),
    ((CPU, torch.float64, True, True), {}), ((), {"dtype": torch.float64, "copy": True}),
    (("real64",), {}), (("real64", False, True), {}), ((), {"tensor": "real64"}),
    ((), {"memory_format": torch.contiguous_format}), ((float,), {}), ((int,), {}), ((bool,), {}),
    ((complex,), {}), ((), {"dtype": float}), (("cpu", int), {}), ((True,), {}),
]


def _form(args, kwargs):
    real64 = torch.zeros(1, dtype=torch.float64)
    return (tuple(real64 if a == "real64" else a for a in args),
            {k: real64 if v == "real64" else v for k, v in kwargs.items()})


@pytest.mark.parametrize("args, kwargs", TENSOR_FORMS, ids=str)
def test_tensor_to_inside_constructor(args, kwargs):
    """Tensor.to forms on a deferred tensor (a transposed random one) and on a
    real tensor from outside, inside a constructor; a draw follows."""
    args, kwargs = _form(args, kwargs)
    pre = torch.arange(6.0).reshape(2, 3)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("a", (torch.randn(3, 2) * 10).t().to(*args, **kwargs))
            self.register_buffer("b", pre.to(*args, **kwargs))
            self.p = nn.Parameter(torch.randn(2))

    eager, d = check_exact(M)
    assert not is_deferred(d.b) or d.b is not pre


@pytest.mark.parametrize("args, kwargs", TENSOR_FORMS, ids=str)
def test_tensor_to_after_deferral(args, kwargs):
    args, kwargs = _form(args, kwargs)
    torch.manual_seed(0)
    expected = nn.Linear(4, 3).weight.detach().t().to(*args, **kwargs)
    torch.manual_seed(0)
    got = deferred_init(nn.Linear, 4, 3).weight.detach().t().to(*args, **kwargs)
    assert (got.dtype, got.device, got.stride()) == (expected.dtype, expected.device, expected.stride())
    materialize_tensor(got)
    assert torch.equal(got, expected)


PYTHON_DTYPES = {
    "ones(4, 4, dtype=bool) causal mask": lambda w: torch.tril(torch.ones(4, 4, dtype=bool)).view(1, 1, 4, 4),
    "zeros(dtype=int)": lambda w: torch.zeros(3, dtype=int),
    "ones(dtype=float)": lambda w: torch.ones(3, dtype=float),
    "zeros(dtype=complex)": lambda w: torch.zeros(2, dtype=complex),
    "empty(dtype=float).normal_()": lambda w: torch.empty(3, dtype=float).normal_(),
    "empty(dtype=int).fill_(3)": lambda w: torch.empty(3, dtype=int).fill_(3),
    "arange(dtype=float)": lambda w: torch.arange(5, dtype=float),
    "full(dtype=int)": lambda w: torch.full((2,), 7, dtype=int),
    "randn(dtype=float)": lambda w: torch.randn(3, dtype=float),
    "new_zeros(dtype=bool)": lambda w: w.new_zeros(2, dtype=bool),
    "zeros_like(dtype=int)": lambda w: torch.zeros_like(w, dtype=int),
    "w.to(float)": lambda w: w.to(float),
    "(w * 10).to(int)": lambda w: (w * 10).to(int),
    "w.to(bool)": lambda w: w.to(bool),
    "w.sum(dtype=float)": lambda w: w.sum(dtype=float),
    "w.new_tensor([1, 2], dtype=float)": lambda w: w.new_tensor([1, 2], dtype=float),
}


class PyDtypes(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("b", make(self.w.detach()))
        self.v = nn.Parameter(torch.randn(2))


@pytest.mark.parametrize("name", list(PYTHON_DTYPES))
def test_python_types_as_dtypes(name):
    """Item 20: the record holds torch dtypes, as the dispatcher sees them."""
    check_exact(PyDtypes, PYTHON_DTYPES[name])


@pytest.mark.parametrize("name", ["ones(4, 4, dtype=bool) causal mask", "w.to(float)", "zeros(dtype=complex)"])
def test_python_types_as_dtypes_on_a_cuda_record(name):
    torch.manual_seed(0)
    eager = PyDtypes(PYTHON_DTYPES[name])
    torch.manual_seed(0)
    with torch.device("cuda"):
        d = deferred_init(PyDtypes, PYTHON_DTYPES[name])
    assert d.b.device == CUDA0 and d.b.dtype == eager.b.dtype
    materialize_module(d, device="cpu")
    assert_same_tensors(eager, d)


def test_invalid_dtype_in_a_factory_fails_as_eager():
    with pytest.raises(TypeError) as eager:
        torch.ones(2, dtype=str)
    with pytest.raises(TypeError) as deferred:
        deferred_init(lambda: torch.ones(2, dtype=str))
    assert str(deferred.value) == str(eager.value)
