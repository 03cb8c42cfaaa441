"""Operators without a meta kernel, operators that read values, and errors that
must not pass for "not implemented" (issue 11, items 9 and 13).

- ``geqrf`` & co. have no meta kernel but a geometry that the data does not
  decide: it is computed from CPU stand-ins and the op is recorded normally.
- Ops whose output shape is read from the data (``nonzero``, boolean masks)
  and ops that return a number read from the data (``torch.allclose``) are
  computed from the values, as ``.item()`` is, for deferred tensors; plain
  fakes refuse them with a named error.
- ``UnsupportedOperatorError`` is not a ``NotImplementedError``, so
  ``parametrize``'s ``right_inverse`` and user fallbacks never mistake it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrizations as P

from deferinit.fake import dispatch as fake_dispatch
from deferinit import deferred_init
from deferinit.fake import FakeDataAccessError, FakeTensorError, UnsupportedOperatorError, fake_mode
from helpers import assert_same_tensors, check_exact
from deferinit.materialize import materialize_module

ORTHOGONAL = {
    "Linear(5,3)": lambda: P.orthogonal(nn.Linear(5, 3)),
    "Linear(3,5)": lambda: P.orthogonal(nn.Linear(3, 5)),
    "Linear(5,5)": lambda: P.orthogonal(nn.Linear(5, 5)),
    "Linear(5,3) cayley": lambda: P.orthogonal(nn.Linear(5, 3), orthogonal_map="cayley"),
    "Linear(4,4) cayley": lambda: P.orthogonal(nn.Linear(4, 4), orthogonal_map="cayley"),
    "Linear(5,3) householder": lambda: P.orthogonal(nn.Linear(5, 3), orthogonal_map="householder"),
    "Linear(4,4) householder": lambda: P.orthogonal(nn.Linear(4, 4), orthogonal_map="householder"),
    "Linear(4,4) matrix_exp": lambda: P.orthogonal(nn.Linear(4, 4), orthogonal_map="matrix_exp"),
    "Linear(5,3) no trivialization": lambda: P.orthogonal(nn.Linear(5, 3), use_trivialization=False),
    "Linear(4,4) no trivialization": lambda: P.orthogonal(nn.Linear(4, 4), use_trivialization=False),
    "Linear(6,4, float64)": lambda: P.orthogonal(nn.Linear(6, 4, dtype=torch.float64)),
}


@pytest.mark.parametrize("name", list(ORTHOGONAL))
def test_orthogonal_parametrization(name):
    eager, deferred = check_exact(ORTHOGONAL[name])
    assert torch.equal(eager.weight, deferred.weight)
    assert hasattr(eager.parametrizations.weight[0], "base") == hasattr(deferred.parametrizations.weight[0], "base")


FALLBACKS = {
    "geqrf": lambda w: torch.geqrf(w)[0],
    "geqrf tau": lambda w: torch.geqrf(w.T[:3])[1],
    "householder_product": lambda w: torch.linalg.householder_product(*torch.geqrf(w)),
    "ormqr": lambda w: torch.ormqr(*torch.geqrf(w), w),
    "batched geqrf": lambda w: torch.geqrf(w.reshape(2, 2, 4))[0],
    "histogram": lambda w: torch.histogram(w.flatten(), 5).hist,
    "geqrf out=": lambda w: torch.geqrf(w, out=(torch.empty(0), torch.empty(0)))[0],
}


@pytest.mark.parametrize("op", list(FALLBACKS))
def test_constructor_fallback_on_not_implemented_is_not_taken(op):
    """A constructor that falls back on NotImplementedError takes eager's branch."""

    class Fallback(nn.Module):
        def __init__(self):
            super().__init__()
            w = torch.randn(4, 4)
            try:
                q = FALLBACKS[op](w)
                self.branch = "op"
            except NotImplementedError:
                q = w.clone()
                self.branch = "fallback"
            self.register_buffer("q", q)
            self.p = nn.Parameter(torch.randn(2))

    eager, deferred = check_exact(Fallback)
    assert deferred.branch == eager.branch == "op"


@pytest.mark.parametrize("shape, dtype", [
    ((5, 3), torch.float32), ((3, 5), torch.float64), ((2, 4, 4), torch.float32), ((4, 2), torch.complex64),
])
def test_geometry_from_standins_matches_eager(shape, dtype):
    real = torch.randn(shape, dtype=dtype)
    expected = torch.geqrf(real)
    with fake_mode(fake_cuda=True):
        got = torch.geqrf(torch.randn(shape, dtype=dtype, device="cuda"))
    for e, g in zip(expected, got):
        assert (g.shape, g.stride(), g.dtype, g.device.type) == (e.shape, e.stride(), e.dtype, "cuda")


def test_cuda_record_with_geqrf_materializes_on_cpu():
    torch.manual_seed(0)
    eager = P.orthogonal(nn.Linear(5, 3))
    torch.manual_seed(0)
    deferred = deferred_init(lambda: P.orthogonal(nn.Linear(5, 3, device="cuda")))
    assert deferred.parametrizations.weight.original.device.type == "cuda"
    materialize_module(deferred, device="cpu")
    assert_same_tensors(eager, deferred)


DATA_DEPENDENT = {
    "nonzero": lambda t: torch.nonzero(t > 0),
    "masked_select": lambda t: t.masked_select(t > 0),
    "unique": lambda t: torch.unique((t * 3).round()),
    "boolean mask index": lambda t: t[t > 0],
    "boolean mask write": lambda t: t.clone().index_put_((t > 0,), torch.tensor(0.0)),
    "mask then in-place": lambda t: t.diagonal()[t.diagonal() > 0].mul_(-1),
    "repeat_interleave(tensor)": lambda t: torch.repeat_interleave(torch.tensor([1, 2, 3])),
}


@pytest.mark.parametrize("op", list(DATA_DEPENDENT))
def test_data_dependent_shapes_are_computed_like_item(op):
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            t = torch.randn(4, 4)
            self.register_buffer("picked", DATA_DEPENDENT[op](t))
            self.register_buffer("t", t)
            self.p = nn.Parameter(torch.randn(3))

    check_exact(DataDependent)


def test_data_dependent_op_on_a_deferred_tensor_after_deferral():
    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    torch.manual_seed(0)
    deferred = deferred_init(nn.Linear, 4, 4)
    got = torch.nonzero(deferred.weight > 0)
    expected = torch.nonzero(eager.weight > 0)
    assert got.shape == expected.shape
    from deferinit.materialize import materialize_tensor

    assert torch.equal(materialize_tensor(got), expected)


ALLCLOSE = {
    "allclose(w, w)": lambda w: torch.allclose(w, w),
    "allclose(w, w + 1e-9)": lambda w: torch.allclose(w, w + 1e-9),
    "allclose(w, zeros_like)": lambda w: torch.allclose(w, torch.zeros_like(w)),
    "allclose(w, real zeros)": lambda w: torch.allclose(w, torch.zeros(4, 4)),
    "w.allclose(w.T, atol=10)": lambda w: w.allclose(w.T, atol=10),
    "allclose(w, w.T)": lambda w: torch.allclose(w, w.T),
    "isclose().all()": lambda w: bool(torch.isclose(w, w).all()),
    "equal(w, w.clone())": lambda w: torch.equal(w, w.clone()),
}


@pytest.mark.parametrize("how", list(ALLCLOSE))
def test_allclose_in_constructor(how):
    class AllClose(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))
            self.flag = ALLCLOSE[how](self.w.detach())
            self.after = nn.Parameter(torch.randn(3))

    eager, deferred = check_exact(AllClose)
    assert deferred.flag == eager.flag


def test_a_kernel_that_reads_values_is_data_access_on_plain_fakes():
    with fake_mode():
        w = torch.empty(3)  # no value to know (torch.ones' is known: fake.md#known-values)
        with pytest.raises(FakeDataAccessError, match=r"torch\.allclose\(\) needs the data"):
            torch.allclose(w, w)
        with pytest.raises(UnsupportedOperatorError, match="depends on the data"):
            torch.nonzero(w)


def test_unsupported_operator_error_is_not_a_not_implemented_error():
    assert not issubclass(UnsupportedOperatorError, NotImplementedError)
    assert issubclass(UnsupportedOperatorError, FakeTensorError)


def test_standins_over_the_limit_are_refused(monkeypatch):
    monkeypatch.setattr(fake_dispatch, "STANDIN_LIMIT_BYTES", 1000)

    class LargeGeqrf(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("q", torch.geqrf(torch.randn(64, 64))[0])

    with pytest.raises(UnsupportedOperatorError) as info:
        deferred_init(LargeGeqrf)
    message = str(info.value)
    assert "aten.geqrf" in message and "DEFERINIT_STANDIN_LIMIT_BYTES=1000" in message and "LargeGeqrf" in message
    assert "16384 bytes of stand-ins" in message


def test_unsupported_message_keeps_whole_words():
    """PyTorch's message is quoted up to a word boundary, never cut mid-word."""
    from deferinit.fake.dispatch import _excerpt

    line = "Could not run 'aten::something' with arguments from the 'Meta' backend. " * 10
    excerpt = _excerpt(line + "\nsecond line")
    assert excerpt.endswith(" ...") and line.startswith(excerpt[:-4]) and len(excerpt) <= 244
    assert excerpt[:-4].split(" ")[-1] in line.split(" ")
    assert _excerpt("short\nsecond") == "short"


@pytest.mark.parametrize("op", [torch.equal, torch.allclose])
def test_value_reading_ops_on_real_tensors_in_fake_mode_answer_as_eagerly(op):
    a, b = torch.ones(3), torch.ones(3) + 1e-9
    expected = op(a, b)
    with fake_mode():
        assert op(a, b) == expected
        with pytest.raises(FakeDataAccessError):
            op(a, torch.empty(3))
