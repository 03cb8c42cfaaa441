"""A real tensor given a fake's memory (issue 20): ``real.data = fake``, ``real.set_(fake, ...)``,
``vector_to_parameters`` and ``Module._apply`` into real parameters.

Before ``fake/assign.py`` these left a Parameter that looked real and had no
memory, and the next kernel reading it killed the process (SIGSEGV), so each
check runs in a subprocess.  The reference is eager PyTorch: the same
assignments between real tensors, the same seed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from deferinit import deferred, is_deferred
from deferinit.fake import FakeIntoRealError, is_fake
from deferinit.materialize import materialize_module, materialize_tensor

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import torch, torch.nn as nn
from deferinit import deferred, is_deferred
from deferinit.fake import FakeIntoRealError, fake_mode, is_fake
from deferinit.materialize import materialize_module, materialize_tensor
"""


def isolated(body: str, timeout: int = 300) -> str:
    """Run ``body`` in a fresh interpreter; fail with its output if it dies or asserts."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert r.returncode == 0, f"exit status {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    return r.stdout


def test_data_of_a_real_parameter_set_to_a_deferred_tensor_equals_eager():
    out = isolated("""
    class Tagged(nn.Parameter):
        pass

    def build(defer):
        torch.manual_seed(0)
        dst = nn.Linear(3, 4)                      # real, made before the deferral
        dst.weight.note = "kept"
        dst.extra = Tagged(torch.zeros(2))
        if defer:
            with deferred():
                src = nn.Linear(3, 4)
        else:
            src = nn.Linear(3, 4)
        w, b, x = dst.weight, dst.bias, dst.extra
        dst.weight.data = src.weight
        dst.bias.data = src.bias[:2] * 2           # a view, and a computed value
        dst.extra.data = src.weight[0]
        assert dst.weight is w and dst.bias is b and dst.extra is x   # the same objects
        if defer:
            assert is_fake(w) and is_deferred(w) and isinstance(w, nn.Parameter) and w.requires_grad
            assert isinstance(x, Tagged) and w.note == "kept"
            float(w.sum())                          # runs on the fake: no crash
            materialize_module(dst)
            materialize_module(src)
        return dst, src, torch.rand(4)

    (e, es, eg), (d, ds, dg) = build(False), build(True)
    for name in ("weight", "bias", "extra"):
        x, y = getattr(e, name), getattr(d, name)
        assert type(x) is type(y) and x.requires_grad == y.requires_grad, name
        assert torch.equal(x, y), name
    assert d.weight.note == "kept"
    # eagerly dst.weight shares src.weight's memory: so does the materialized one
    assert d.weight.untyped_storage().data_ptr() == ds.weight.untyped_storage().data_ptr()
    assert torch.equal(eg, dg), "the generator after differs from eager"
    print("ok")
    """)
    assert "ok" in out


def test_vector_to_parameters_into_real_parameters_equals_eager():
    out = isolated("""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    def build(defer):
        torch.manual_seed(0)
        real = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        if defer:
            with deferred():
                src = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        else:
            src = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        vector_to_parameters(parameters_to_vector(src.parameters()), real.parameters())
        if defer:
            assert is_deferred(real)
            materialize_module(real)
            materialize_module(src)
        return real, torch.rand(4)

    (e, eg), (d, dg) = build(False), build(True)
    for (n, x), (_, y) in zip(e.named_parameters(), d.named_parameters()):
        assert type(x) is type(y) and torch.equal(x, y), n
    ptrs = {p.untyped_storage().data_ptr() for p in d.parameters()}
    assert len(ptrs) == 1, "eagerly every parameter is a view of the one vector"
    assert torch.equal(eg, dg)
    print("ok")
    """)
    assert "ok" in out


def test_set_overloads_with_a_fake_source_on_a_real_tensor_equal_eager():
    out = isolated("""
    def build(defer, how):
        torch.manual_seed(0)
        real = torch.zeros(5)
        if defer:
            with deferred():
                src = torch.rand(12)
        else:
            src = torch.rand(12)
        if how == "tensor":
            real.set_(src)
        elif how == "geometry":
            real.set_(src, 2, (2, 3), (3, 1))
        else:
            real.set_(source=src, storage_offset=1, size=(4,), stride=(2,))
        if defer:
            assert is_deferred(real)
            holder = nn.Module()
            holder.register_buffer("t", real)
            materialize_module(holder)
        return real

    for how in ("tensor", "geometry", "keywords"):
        e, d = build(False, how), build(True, how)
        assert not is_fake(d) and torch.equal(e, d) and e.stride() == d.stride(), how

    # eager refuses set_ on a leaf that requires grad: the same error, nothing changed
    with deferred():
        src = torch.rand(3)
    p = nn.Parameter(torch.ones(3))
    try:
        p.set_(src, 0, (3,), (1,))
        raise AssertionError("set_ on a leaf requiring grad was allowed")
    except RuntimeError as e:
        assert "leaf Variable that requires grad" in str(e)
    assert not is_fake(p) and torch.equal(p, torch.ones(3)) and type(p) is nn.Parameter
    print("ok")
    """)
    assert "ok" in out


def test_plain_fakes_and_module_apply():
    out = isolated("""
    with fake_mode():
        f = torch.ones(2, 3)
    t = torch.zeros(4)
    t.data = f
    assert is_fake(t) and not is_deferred(t) and t.shape == (2, 3)
    assert (t * 2).shape == (2, 3)

    # Module._apply sets .data of each parameter: the real module becomes deferred
    with deferred():
        donor = nn.Linear(2, 2)
    torch.manual_seed(3)
    real = nn.Linear(2, 2)
    real._apply(lambda p: donor.weight if p.dim() == 2 else donor.bias)
    assert is_deferred(real.weight) and is_deferred(real.bias)
    materialize_module(donor)
    materialize_module(real)
    assert torch.equal(real.weight, donor.weight) and torch.equal(real.bias, donor.bias)
    print("ok")
    """)
    assert "ok" in out


def test_what_cannot_become_a_fake_is_refused_and_left_as_it_was():
    out = isolated("""
    with deferred():
        f = torch.rand(3)

    def refused(real, match):
        before = real.detach().clone()
        try:
            real.data = f
        except FakeIntoRealError as e:
            assert match in str(e) and "tensor.data = fake" in str(e), str(e)
        else:
            raise AssertionError("not refused: " + match)
        assert not is_fake(real) and torch.equal(real.detach(), before)

    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    refused(p, "has a .grad")
    base = torch.ones(6)
    refused(base[:3], "not a leaf")
    with torch.inference_mode():
        inf = torch.ones(3)
    refused(inf, "inference tensor")

    # eager's own check on dtypes comes first, nothing changed
    q = nn.Parameter(torch.ones(3))
    with deferred():
        ints = torch.arange(3)
    try:
        q.data = ints
    except RuntimeError as e:
        assert "must be floating point or complex" in str(e)
    else:
        raise AssertionError("integer data on a parameter requiring grad was allowed")
    assert not is_fake(q)
    print("ok")
    """)
    assert "ok" in out


def test_data_of_real_tensors_is_pytorchs_own():
    """Between real tensors (and between fakes) nothing changes: PyTorch's setter."""
    from deferinit.fake.assign import DATA

    assert torch.Tensor.data is DATA
    a, b = torch.zeros(3), torch.arange(4.0)
    a.data = b
    assert torch.equal(a, b) and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.data.data_ptr() == b.data_ptr()
    p = torch.nn.Parameter(torch.ones(2))
    p.data = torch.zeros(2)
    assert type(p) is torch.nn.Parameter and torch.equal(p, torch.zeros(2))
    c = torch.empty(0).set_(b.untyped_storage(), 1, (2,), (1,))
    assert c.tolist() == [1.0, 2.0]
    with pytest.raises(RuntimeError, match="floating point or complex"):
        p.data = torch.arange(2)


# -- found in review: hooks, inference mode, eager's refusals, the first fake ---------------


def _hooked(p: torch.Tensor, calls: list) -> torch.Tensor:
    p.register_hook(lambda g: g * 100)
    p.register_post_accumulate_grad_hook(lambda t: calls.append(t.grad.clone()))
    return p


def test_gradient_hooks_of_a_real_tensor_given_a_fakes_memory_equal_eager():
    """Eagerly ``p.data = t`` keeps ``p``'s hooks (they belong to ``p``, not to its
    data); a real tensor becoming a fake in place, and materialized, keeps them too.
    (They were moved away with the C++ tensor: gradients skipped them, silently.)"""

    def build(defer):
        torch.manual_seed(0)
        calls = []
        p = _hooked(nn.Parameter(torch.zeros(2)), calls)
        if defer:
            with deferred():
                src = nn.Linear(3, 4)
        else:
            src = nn.Linear(3, 4)
        p.data = src.weight
        if defer:
            materialize_module(src)
            materialize_tensor(p)
        (p * torch.arange(12.0).view(4, 3)).sum().backward()
        return p, calls

    (e, e_calls), (d, d_calls) = build(False), build(True)
    assert torch.equal(e, d) and torch.equal(e.grad, d.grad)
    assert torch.equal(d.grad, 100 * torch.arange(12.0).view(4, 3))
    assert len(e_calls) == len(d_calls) == 1 and torch.equal(e_calls[0], d_calls[0])


def test_gradient_hooks_registered_on_deferred_parameters_survive_materialization():
    """The same exchange puts materialized tensors into the fake objects."""

    def build(defer):
        torch.manual_seed(0)
        calls = []
        if defer:
            with deferred():
                m = nn.Linear(3, 4)
        else:
            m = nn.Linear(3, 4)
        _hooked(m.weight, calls)
        if defer:
            materialize_module(m)
        m(torch.ones(2, 3)).sum().backward()
        return m, calls

    (e, e_calls), (d, d_calls) = build(False), build(True)
    assert torch.equal(e.weight.grad, d.weight.grad) and torch.equal(e.bias.grad, d.bias.grad)
    assert len(d_calls) == len(e_calls) == 1 and torch.equal(d_calls[0], e_calls[0])


def test_data_set_to_a_fake_under_inference_mode_equals_eager():
    """Eagerly allowed (the parameter stays a normal tensor); it raised PyTorch's
    'Cannot set version_counter for inference tensor'."""

    def build(defer):
        torch.manual_seed(0)
        p = nn.Parameter(torch.zeros(2))
        if defer:
            with deferred():
                src = nn.Linear(3, 4)
        else:
            src = nn.Linear(3, 4)
        with torch.inference_mode():
            p.data = src.weight if defer else src.weight.detach()
        if defer:
            materialize_module(src)
            materialize_tensor(p)
        (p * 2).sum().backward()
        return p

    e, d = build(False), build(True)
    assert not d.is_inference() and d.requires_grad and type(d) is nn.Parameter
    assert torch.equal(e, d) and torch.equal(e.grad, d.grad)


def _outcome(fn):
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the outcome compared is the error
        return type(e), None
    return None, (out.dtype, out.device.type, tuple(out.shape))


def test_what_eager_refuses_between_real_tensors_is_refused_with_a_fake():
    """``.data =`` of tensors of incompatible kinds, ``set_`` across dtypes or
    devices: eager's error, not a real tensor silently turned into a fake of
    another kind; the tensor is left as it was."""
    with deferred():
        half, floats = torch.rand(3, dtype=torch.float16), torch.rand(3)

    def data(t, x):
        t.data = x
        return t

    cases = {
        "set_ across dtypes": lambda x, h: torch.zeros(2).set_(h),
        "set_ onto meta": lambda x, h: torch.zeros(2, device="meta").set_(x),
        ".data of a meta tensor": lambda x, h: data(torch.zeros(2, device="meta"), x),
        ".data of a sparse tensor": lambda x, h: data(torch.zeros(2, 2).to_sparse(), x),
        ".data across dtypes (allowed)": lambda x, h: data(torch.zeros(2), h),
    }
    for name, case in cases.items():
        eager = _outcome(lambda: case(torch.zeros(3), torch.zeros(3, dtype=torch.float16)))
        ours = _outcome(lambda: case(floats, half))
        assert ours == eager, name
    # on a device the Fake layer stands for, as eagerly between CPU and CUDA tensors
    with deferred():
        on_cuda = torch.rand(3, device="cuda")
    t = torch.zeros(2)
    with pytest.raises(RuntimeError, match="devices must match"):
        t.set_(on_cuda)
    assert not is_fake(t) and torch.equal(t, torch.zeros(2))
    assert data(torch.zeros(2), on_cuda).device == torch.device("cuda", 0)
    # set_ with a geometry reads the memory as the destination's dtype: not for a fake
    t = torch.zeros(2)
    with pytest.raises(FakeIntoRealError, match="reinterpreted"):
        t.set_(half, 0, (1,), (1,))
    assert not is_fake(t)


def test_a_parameter_class_with_slots_is_refused_with_our_error():
    class Slotted(nn.Parameter):
        __slots__ = ("tag",)

    with deferred():
        f = torch.rand(3)
    p = Slotted(torch.zeros(2))
    with pytest.raises(FakeIntoRealError, match="Slotted cannot"):
        p.data = f
    assert not is_fake(p) and type(p) is Slotted and torch.equal(p, torch.zeros(2))


def test_torch_is_left_alone_until_the_first_fake_and_after_the_last():
    """Importing the packages changes nothing in torch.Tensor (a process that
    never makes a fake runs PyTorch's own .data and set_); the first fake
    installs them, the last one gone takes them away."""
    out = isolated("""
    import pickle
    names = ("data", "set_")
    assert not any(n in vars(torch.Tensor) for n in names), [n for n in names if n in vars(torch.Tensor)]
    p = nn.Parameter(torch.zeros(2))
    p.data = torch.ones(2)
    assert torch.equal(p, torch.ones(2)) and not any(n in vars(torch.Tensor) for n in names)
    with deferred():
        m = nn.Linear(2, 2)
    assert all(n in vars(torch.Tensor) for n in names)
    assert pickle.loads(pickle.dumps(torch.Tensor.set_)) is torch.Tensor.set_
    q = nn.Parameter(torch.zeros(4))
    q.data = m.weight
    assert is_deferred(q)
    del m, q
    import gc
    gc.collect()
    # The last fake gone: PyTorch's own again.
    assert not any(n in vars(torch.Tensor) for n in names), [n for n in names if n in vars(torch.Tensor)]
    print("ok")
    """)
    assert "ok" in out
