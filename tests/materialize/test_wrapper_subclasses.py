"""Wrapper tensor subclasses inside a deferral: recorded through their inner tensors,
rebuilt at materialization (issue 25, item 1).

The subclasses here are PyTorch's own test subclass (``TwoTensor``) and one
written below the way quantization libraries write theirs (``Int8Rows``):
the mechanism names neither.  Every test compares with the same code run
eagerly; the libraries' own subclasses are in test_quantization_libraries.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._pytree import tree_map

from deferinit import AutogradMaterializationError, MaterializationError, deferred, deferred_init, is_deferred
from deferinit.fake import is_fake
from deferinit.materialize import materialize_module, materialize_tensor
from helpers import assert_same_wrapped

aten = torch.ops.aten


class Int8Rows(torch.Tensor):
    """A weight kept as int8 rows and one float scale per row, written as
    quantization libraries write theirs: a wrapper with ``__tensor_flatten__``,
    ``__tensor_unflatten__`` and a ``__torch_dispatch__`` that handles the
    aliasing ops on its inner tensors and computes everything else on its
    dequantized values."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, qdata, scale, dtype, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=dtype, device=qdata.device, requires_grad=requires_grad
        )

    def __init__(self, qdata, scale, dtype, requires_grad=False):
        self.qdata = qdata
        self.scale = scale

    def __tensor_flatten__(self):
        return ["qdata", "scale"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Int8Rows(inner["qdata"], inner["scale"], ctx["dtype"])

    @classmethod
    def from_float(cls, w):
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
        qdata = (w / scale).round().clamp(-128, 127).to(torch.int8)
        return cls(qdata, scale, w.dtype)

    def dequantize(self):
        return self.qdata.to(self.dtype) * self.scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0]
        if func in (aten.detach.default, aten.clone.default, aten.alias.default):
            return cls(func(x.qdata), func(x.scale), x.dtype)
        if func is aten.slice.Tensor and (args[1] if len(args) > 1 else 0) == 0:
            return cls(func(x.qdata, *args[1:]), func(x.scale, *args[1:]), x.dtype)
        if func is aten._to_copy.default and kwargs.get("dtype") in (None, x.dtype):
            moved = {k: v for k, v in kwargs.items() if k != "dtype"}
            return cls(func(x.qdata, **moved), func(x.scale, **moved), x.dtype)
        plain = tree_map(lambda a: a.dequantize() if isinstance(a, cls) else a, (args, kwargs))
        return func(*plain[0], **plain[1])


class QuantLinear(nn.Module):
    """A linear layer whose weight is quantized at construction (QLoRA builders do this)."""

    def __init__(self, i, o, device=None):
        super().__init__()
        lin = nn.Linear(i, o, device=device)
        self.weight = nn.Parameter(Int8Rows.from_float(lin.weight.detach()), requires_grad=False)
        self.bias = lin.bias

    def forward(self, x):
        return nn.functional.linear(x, self.weight.dequantize(), self.bias)


def _twice(fn):
    """``fn()`` eagerly and inside a deferral from the same seed, the deferred one
    materialized; also what the default generator draws next after each."""
    torch.manual_seed(0)
    eager = fn()
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    with deferred():
        d = fn()
    assert is_deferred(d)
    materialize_module(d)
    return eager, d, eager_next, torch.rand(4)


def test_parameter_of_a_wrapper_made_inside_the_block():
    """nn.Parameter(wrapper) used to raise PyTorch's "detach() returns an instance
    of the same type": the deferral took the wrapper for a plain tensor."""

    def build():
        m = nn.Module()
        m.w = nn.Parameter(TwoTensor(torch.randn(3, 4), torch.randn(3, 4)))
        m.w.tag = "kept"
        return m

    eager, d, eager_next, d_next = _twice(build)
    assert type(d.w) is TwoTensor and isinstance(d.w, nn.Parameter) and d.w.requires_grad
    assert d.w.tag == "kept"
    assert_same_wrapped(eager, d)
    assert torch.equal(eager_next, d_next)


def test_quantizing_wrapper_inside_the_block_equals_eager():
    eager, d, eager_next, d_next = _twice(lambda: nn.Sequential(QuantLinear(16, 8), nn.ReLU(), QuantLinear(8, 4)))
    assert type(d[0].weight) is Int8Rows and not d[0].weight.requires_grad
    assert d[0].weight.qdata.dtype == torch.int8
    assert_same_wrapped(eager, d)
    assert torch.equal(eager_next, d_next)
    x = torch.randn(2, 16)
    assert torch.equal(eager(x), d(x))


def test_quantizing_after_the_block_equals_eager():
    """Converting a deferred model after the block (what torchao's quantize_ does)
    records the conversion on the deferred weights."""

    def quantize(model):
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight = nn.Parameter(Int8Rows.from_float(m.weight.detach()), requires_grad=False)
        return model

    torch.manual_seed(0)
    eager = quantize(nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4)))
    torch.manual_seed(0)
    with deferred():
        d = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4))
    quantize(d)
    assert type(d[0].weight) is Int8Rows and is_deferred(d) and is_deferred(d[0].weight)
    materialize_module(d)
    assert_same_wrapped(eager, d)


def test_detach_clone_views_and_own_ops_behave_as_eagerly():
    """detach() of a wrapper made inside the block returned a plain tensor, and
    clone() said it came "from outside"."""

    def build():
        m = nn.Module()
        t = TwoTensor(torch.randn(4, 6), torch.randn(4, 6))
        m.t = t
        m.detached = t.detach()
        m.cloned = t.clone()
        m.row = t[1]
        m.viewed = t.view(6, 4)
        m.transposed = t.t()
        m.computed = t * 2 + 1
        m.nested = TwoTensor(TwoTensor(torch.ones(2), torch.zeros(2)), TwoTensor(torch.randn(2), torch.randn(2)))
        return m

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    with deferred():
        d = build()
        for name in ("detached", "cloned", "row", "viewed", "transposed", "computed", "nested"):
            assert type(getattr(d, name)) is TwoTensor, name
    materialize_module(d)
    assert_same_wrapped(eager, d)
    # Views alias their base's inner tensors, as eagerly.
    for name in ("detached", "row", "viewed", "transposed"):
        for inner in ("a", "b"):
            view, base = getattr(getattr(d, name), inner), getattr(d.t, inner)
            assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), (name, inner)
    assert d.cloned.a.untyped_storage().data_ptr() != d.t.a.untyped_storage().data_ptr()


def test_is_deferred_looks_inside_and_materialize_tensor_rebuilds():
    with deferred():
        w = TwoTensor(torch.randn(3), torch.randn(3))
    assert is_deferred(w) and is_fake(w.a)
    assert materialize_tensor(w) is w
    assert type(w) is TwoTensor and not is_deferred(w) and not is_fake(w.a) and not is_fake(w.b)
    assert w.device == torch.device("cpu")


def test_recorded_on_a_fake_device_rebuilt_on_the_one_materialized_on():
    """The wrapper reported the device of its fakes; rebuilt, it reports its inner tensors'."""
    torch.manual_seed(0)
    eager = QuantLinear(16, 8)
    torch.manual_seed(0)
    with deferred():
        d = QuantLinear(16, 8, device="cuda")
    assert d.weight.device.type == "cuda"
    materialize_module(d, device="cpu")
    assert d.weight.device.type == "cpu" and d.weight.qdata.device.type == "cpu"
    assert_same_wrapped(eager, d)


def test_buffers_only_leaves_wrapper_parameters():
    with deferred():
        d = QuantLinear(16, 8)
        d.register_buffer("table", TwoTensor(torch.ones(2), torch.zeros(2)))
    materialize_module(d, buffers_only=True)
    assert not is_deferred(d.table) and is_deferred(d.weight)
    materialize_module(d)
    assert not is_deferred(d)


class _Unrebuildable(TwoTensor):
    """Its __tensor_unflatten__ fails: materialization must then change nothing."""

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        raise RuntimeError("cannot rebuild")


def test_a_failed_rebuild_changes_nothing():
    with deferred():
        m = nn.Module()
        m.ok = nn.Parameter(torch.randn(2))
        m.bad = _Unrebuildable(torch.randn(2), torch.randn(2))
    ok, bad_a = m.ok, m.bad.a
    with pytest.raises(MaterializationError, match="rebuilding a _Unrebuildable"):
        materialize_module(m)
    assert is_deferred(m) and is_fake(ok) and is_fake(bad_a) and m.bad.a is bad_a
    assert type(m.bad) is _Unrebuildable


class _InterruptedRebuild(TwoTensor):
    """Its __tensor_unflatten__ is interrupted (Ctrl-C) while ``armed``."""

    armed = False

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        if _InterruptedRebuild.armed:
            raise KeyboardInterrupt
        return _InterruptedRebuild(inner["a"], inner["b"])


def _two_wrapped(device="cpu"):
    m = nn.Module()
    m.first = nn.Parameter(TwoTensor(torch.randn(3, device=device), torch.randn(3, device=device)))
    m.second = nn.Parameter(_InterruptedRebuild(torch.randn(3, device=device), torch.randn(3, device=device)))
    return m


def test_an_interrupt_while_rebuilding_puts_back_the_wrappers_already_rebuilt():
    """``first`` is rebuilt and swapped in before ``second``'s rebuild is
    interrupted: the wrapper object ``first`` is again the one built around
    its fakes (recorded for cuda, it says cuda, not the cpu it was being
    rebuilt on), nothing is real, the generator is untouched, and a later
    call equals eager."""
    torch.manual_seed(0)
    eager = _two_wrapped()
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    with deferred():
        m = _two_wrapped("cuda")
    first, first_a = m.first, m.first.a
    state = torch.get_rng_state()
    _InterruptedRebuild.armed = True
    try:
        with pytest.raises(KeyboardInterrupt):
            materialize_module(m, device="cpu")
    finally:
        _InterruptedRebuild.armed = False
    assert first.device.type == "cuda" and m.second.device.type == "cuda"
    assert m.first is first and type(first) is type(eager.first) and first.a is first_a
    assert is_fake(first.a) and is_fake(m.second.a) and is_deferred(m.first) and is_deferred(m.second)
    assert torch.equal(torch.get_rng_state(), state)
    materialize_module(m, device="cpu")
    assert torch.equal(torch.rand(4), eager_next)
    assert_same_wrapped(eager, m)


def test_a_wrapper_computed_with_autograd_is_refused():
    """Rebuilt from its inner tensors it would be a leaf: eager's graph would be lost."""
    table = TwoTensor(torch.ones(3), torch.full((3,), 3.0))
    m = deferred_init(nn.Linear, 3, 3)
    m.x = m.bias * table
    with pytest.raises(AutogradMaterializationError, match="x is a TwoTensor computed with autograd"):
        materialize_module(m)
    assert is_deferred(m.weight)


class Quantizing(nn.Parameter):
    """A parameter class that converts its data when moved, and keeps what the
    conversion made on itself (what bitsandbytes' Int8Params does), written here."""

    def __new__(cls, data=None, requires_grad=False):
        obj = torch.Tensor._make_subclass(cls, data, requires_grad)
        obj.scale = None
        return obj

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if self.scale is None and device is not None and device.type != "meta":
            scale = self.data.abs().amax(dim=1) / 127
            self.data = (self.data / scale[:, None]).round().to(torch.int8)
            self.scale = scale
            self.extra = {"absmax": [scale * 127]}
            return self
        return super().to(*args, **kwargs)


class QuantizesOnMove(nn.Module):
    def __init__(self):
        super().__init__()
        lin = nn.Linear(8, 4)
        self.weight = Quantizing(lin.weight.data)


@pytest.mark.parametrize("where", ["inside", "after"])
def test_a_parameter_class_that_converts_on_to_runs_as_eagerly(where):
    """Its own .to() ran after the fake's, so the weight stayed float32 and no
    scale was made; and the tensors it keeps on itself must become real."""
    torch.manual_seed(0)
    eager = QuantizesOnMove().to("cpu")
    torch.manual_seed(0)
    with deferred():
        d = QuantizesOnMove()
        if where == "inside":
            d = d.to("cpu")
    if where == "after":
        d = d.to("cpu")
    assert d.weight.dtype == torch.int8 and is_fake(d.weight.scale)
    assert is_deferred(d)
    materialize_module(d)
    assert type(d.weight) is Quantizing and not is_fake(d.weight.scale) and not is_fake(d.weight.extra["absmax"][0])
    assert_same_wrapped(eager, d)
    assert torch.equal(d.weight.scale, eager.weight.scale)


def test_materialize_tensor_takes_what_the_tensor_carries():
    torch.manual_seed(0)
    eager = QuantizesOnMove().to("cpu")
    torch.manual_seed(0)
    with deferred():
        d = QuantizesOnMove().to("cpu")
    w = d.weight
    materialize_tensor(w)
    assert not is_fake(w) and not is_fake(w.scale)
    assert torch.equal(w.scale, eager.weight.scale) and torch.equal(w, eager.weight)


def test_an_outside_wrapper_next_to_a_deferred_tensor_after_the_block():
    """FakeTensor's own dispatch gives way to the wrapper, which calls back with
    its inner tensors (before, the recorder took it for an outside plain tensor)."""
    table = TwoTensor(torch.ones(3), torch.full((3,), 3.0))
    torch.manual_seed(0)
    eager = nn.Linear(3, 3)
    with torch.no_grad():
        expected = eager.bias * table
    torch.manual_seed(0)
    d = deferred_init(nn.Linear, 3, 3)
    with torch.no_grad():
        d.register_buffer("x", d.bias * table)
    assert type(d.x) is TwoTensor and is_deferred(d.x)
    materialize_module(d)
    assert torch.equal(d.x.a, expected.a) and torch.equal(d.x.b, expected.b)


def test_a_quantized_model_is_replayed_one_weight_at_a_time(monkeypatch):
    """One replay per wrapper (its inner tensors together), in the order of their
    draws: the full-precision weights never exist all at once, as they would in
    one replay of the record in order (every weight made before the first is
    quantized)."""
    import deferinit.materialize.pipeline as pipeline

    replays = []
    real_replay = pipeline.Replay

    def spy(reads, **kwargs):
        replays.append(kwargs.get("labels"))
        return real_replay(reads, **kwargs)

    monkeypatch.setattr(pipeline, "Replay", spy)

    def quantize(model):
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight = nn.Parameter(Int8Rows.from_float(m.weight.detach()), requires_grad=False)
        return model

    torch.manual_seed(0)
    eager = quantize(nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8), nn.Linear(8, 4)))
    torch.manual_seed(0)
    with deferred():
        d = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 8), nn.Linear(8, 4))
    quantize(d)
    materialize_module(d)
    assert_same_wrapped(eager, d)
    weights = [labels for labels in replays if any(".weight" in l for l in labels)]
    assert weights == [[f"{i}.weight.qdata", f"{i}.weight.scale"] for i in range(3)]
