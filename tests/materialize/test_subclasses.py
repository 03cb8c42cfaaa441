"""Tensor subclasses with a ``__new__`` of their own and lazy modules, deferred
(issue 11, items 14 and 19): ``torch.Tensor._make_subclass(cls, fake)``
gives a fake that is a ``cls``, materialized into an instance of ``cls``; lazy
placeholders stay lazy, and their parameters become deferred at the first
forward, inside the constructor or after it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from deferinit import deferred, deferred_init, is_deferred
from deferinit.fake import fake_mode, is_fake
from helpers import assert_same_tensors, check_exact
from deferinit.materialize import materialize_module


class Int8Params(nn.Parameter):
    """bitsandbytes-like: its own __new__ on _make_subclass, extra attributes."""

    def __new__(cls, data=None, requires_grad=False, has_fp16_weights=False, CB=None, SCB=None):
        if data is None:
            data = torch.empty(0)
        obj = torch.Tensor._make_subclass(cls, data, requires_grad)
        obj.CB, obj.SCB, obj.has_fp16_weights = CB, SCB, has_fp16_weights
        return obj

    def scale(self):
        return self.detach() * 2


class MakeSubclassParam(nn.Parameter):
    def __new__(cls, data, requires_grad=True):
        return torch.Tensor._make_subclass(cls, data, requires_grad)


class TaggedBuffer(torch.Tensor):
    """A buffer class (not a Parameter) built with _make_subclass."""

    def __new__(cls, data, tag):
        obj = torch.Tensor._make_subclass(cls, data)
        obj.tag = tag
        return obj


SUBCLASSES = {
    "Int8Params(randn)": lambda: Int8Params(torch.randn(3, 4), requires_grad=False, has_fp16_weights=True),
    "Int8Params(empty().normal_())": lambda: Int8Params(torch.empty(3, 4).normal_(), CB=1),
    "Int8Params(Linear.weight.data)": lambda: Int8Params(nn.Linear(4, 3).weight.data),
    "Int8Params(requires_grad=True)": lambda: Int8Params(torch.randn(2, 2), requires_grad=True),
    "Int8Params() empty": lambda: Int8Params(),
    "Int8Params(view)": lambda: Int8Params(torch.randn(4, 4)[1:3]),
    "MakeSubclassParam": lambda: MakeSubclassParam(torch.randn(3, 4)),
    "Parameter via _make_subclass": lambda: torch.Tensor._make_subclass(nn.Parameter, torch.randn(2), True),
}


class WithSubclass(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.weight = make()
        self.register_buffer("tagged", TaggedBuffer(torch.randn(2), tag="t"))
        self.after = nn.Parameter(torch.randn(2))


@pytest.mark.parametrize("name", list(SUBCLASSES))
def test_parameter_subclass_with_its_own_new(name):
    seen = {}

    def make():
        p = SUBCLASSES[name]()
        seen.setdefault("made", []).append((type(p), p))
        if len(seen["made"]) == 2:  # the deferred one, while it is fake
            seen["fake is a"] = isinstance(p, seen["made"][0][0]) and is_fake(p)
        return p

    eager, deferred = check_exact(WithSubclass, make)
    assert seen["fake is a"]
    for attr in ("CB", "SCB", "has_fp16_weights"):
        assert getattr(eager.weight, attr, "absent") == getattr(deferred.weight, attr, "absent"), attr
    assert type(deferred.tagged) is TaggedBuffer and deferred.tagged.tag == "t"


def test_subclass_methods_work_on_the_fake():
    torch.manual_seed(0)
    expected = Int8Params(torch.randn(3)).scale()
    torch.manual_seed(0)
    p = deferred_init(lambda: Int8Params(torch.randn(3)))
    assert isinstance(p, Int8Params) and is_deferred(p)
    scaled = p.scale()
    holder = nn.Module()
    holder.p = p
    materialize_module(holder)
    assert type(p) is Int8Params and torch.equal(p.detach() * 2, expected) and is_deferred(scaled)


def test_subclass_in_fake_mode():
    from deferinit.fake.subclass import MAKE_SUBCLASS

    users = MAKE_SUBCLASS.users
    with fake_mode():
        p = Int8Params(torch.ones(2), CB=3)
        assert MAKE_SUBCLASS.users > users
    assert isinstance(p, Int8Params) and is_fake(p) and p.CB == 3
    # the mode's hold is gone; what remains is the fakes' (tests/test_guest.py: none once they die)
    assert MAKE_SUBCLASS.users <= max(users, 1)


def test_subclass_of_a_deferred_tensor_after_the_block():
    """Int8Params(w) of a deferred weight after the block (transformers' bitsandbytes
    quantizer does it) raised "already associated to a python object of type
    FakeTensor": the diversion was held only inside fake modes."""
    torch.manual_seed(0)
    eager = Int8Params(torch.randn(3) * 2, CB=1)
    torch.manual_seed(0)
    with deferred():
        w = torch.randn(3)
    p = Int8Params(w * 2, CB=1)
    assert isinstance(p, Int8Params) and is_deferred(p) and p.CB == 1
    holder = nn.Module()
    holder.p = p
    materialize_module(holder)
    assert type(holder.p) is Int8Params and holder.p.CB == 1 and torch.equal(holder.p, eager)


LAZY = {
    "LazyLinear": (lambda: nn.LazyLinear(4), (2, 3)),
    "LazyLinear(bias=False)": (lambda: nn.LazyLinear(4, bias=False), (5, 6)),
    "LazyConv1d": (lambda: nn.LazyConv1d(4, 3), (1, 2, 7)),
    "LazyConv2d": (lambda: nn.LazyConv2d(4, 3), (1, 2, 5, 5)),
    "LazyConvTranspose2d": (lambda: nn.LazyConvTranspose2d(3, 2), (1, 2, 4, 4)),
    "LazyInstanceNorm1d(affine)": (lambda: nn.LazyInstanceNorm1d(affine=True, track_running_stats=False), (2, 3, 5)),
    "LazyBatchNorm1d": (lambda: nn.LazyBatchNorm1d(), (4, 3)),
    "LazyBatchNorm2d(momentum=None)": (lambda: nn.LazyBatchNorm2d(momentum=None), (2, 3, 4, 4)),
    "Sequential(LazyLinear, ReLU, LazyLinear)": (lambda: nn.Sequential(nn.LazyLinear(5), nn.ReLU(), nn.LazyLinear(2)), (2, 3)),
}


@pytest.mark.parametrize("name", list(LAZY))
def test_lazy_module_forward_inside_constructor(name):
    make, shape = LAZY[name]

    class DryRun(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = make()
            self.inner(torch.zeros(*shape))
            self.head = nn.Linear(2, 2)

    eager, deferred = check_exact(DryRun)
    assert type(eager.inner) is type(deferred.inner)


# Forward passes of these write buffers in training mode (running statistics).
WRITES_IN_TRAINING = ("LazyBatchNorm1d", "LazyBatchNorm2d(momentum=None)")


@pytest.mark.filterwarnings("ignore::deferinit.DeferredModuleWarning")
@pytest.mark.parametrize("name", list(LAZY))
def test_lazy_module_forward_after_deferral(name):
    """The first forward on the deferred module makes its parameters (recorded,
    as construction is); the pass itself runs on fakes, unrecorded."""
    make, shape = LAZY[name]
    torch.manual_seed(1)
    x = torch.randn(*shape)
    torch.manual_seed(0)
    eager = make()
    if name in WRITES_IN_TRAINING:
        eager.eval()
    eager(x)
    torch.manual_seed(0)
    deferred = deferred_init(make)
    if name in WRITES_IN_TRAINING:
        deferred.eval()
    out = deferred(x)
    assert is_deferred(deferred) and is_fake(out) and type(deferred) is type(eager)
    materialize_module(deferred)
    assert_same_tensors(eager, deferred)


@pytest.mark.filterwarnings("ignore::deferinit.DeferredModuleWarning")
@pytest.mark.parametrize("name", WRITES_IN_TRAINING)
def test_lazy_module_forward_that_writes_buffers_is_refused(name):
    """In training mode the pass updates running statistics: a write a pass on
    fakes can neither record nor drop (DeferredWriteError); the parameters the
    lazy module made before it stay deferred and materialize as eagerly."""
    from deferinit import DeferredWriteError

    make, shape = LAZY[name]
    x = torch.randn(*shape)
    torch.manual_seed(0)
    eager = make()
    eager.initialize_parameters(x)
    torch.manual_seed(0)
    deferred = deferred_init(make)
    with pytest.raises(DeferredWriteError, match="running_mean|num_batches_tracked"):
        deferred(x)
    materialize_module(deferred)
    assert_same_tensors(eager, deferred)


@pytest.mark.parametrize("name", ["LazyLinear", "LazyConv2d"])
def test_lazy_module_never_run_stays_uninitialized(name):
    make, shape = LAZY[name]
    torch.manual_seed(0)
    eager = make()
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    deferred = deferred_init(make)
    materialize_module(deferred)
    assert torch.equal(torch.rand(4), eager_next)
    for e, d in zip(eager.parameters(), deferred.parameters()):
        assert type(d) is type(e) is UninitializedParameter and not is_fake(d)
        assert (d.dtype, d.device, d.requires_grad) == (e.dtype, e.device, e.requires_grad)
    torch.manual_seed(1)
    expected = eager(torch.ones(*shape))
    torch.manual_seed(1)
    assert torch.equal(deferred(torch.ones(*shape)), expected)  # lazy as eagerly: real at the first forward
    assert type(deferred.weight) is nn.Parameter


def test_lazy_buffers():
    torch.manual_seed(0)
    eager = nn.LazyBatchNorm1d()
    torch.manual_seed(0)
    deferred = deferred_init(nn.LazyBatchNorm1d)
    assert isinstance(deferred.running_mean, UninitializedBuffer)
    assert repr(deferred.running_mean) == repr(eager.running_mean) == "<UninitializedBuffer>"
    materialize_module(deferred)
    assert type(deferred.running_mean) is UninitializedBuffer


def test_lazy_module_on_cuda_materialized_on_cpu():
    torch.manual_seed(0)
    eager = nn.LazyLinear(3)
    eager(torch.zeros(2, 4))
    torch.manual_seed(0)
    deferred = deferred_init(nn.LazyLinear, 3, device="cuda")
    deferred(deferred_init(torch.zeros, 2, 4, device="cuda"))
    assert deferred.weight.device.type == "cuda" and deferred.weight.shape == (3, 4)
    materialize_module(deferred, device="cpu")
    assert_same_tensors(eager, deferred)


@pytest.mark.slow
def test_dynamo_imported_during_recording_registers_pytorchs_own_make_subclass():
    """torch._dynamo substitutes torch.Tensor._make_subclass when first imported:
    even mid-recording it must see PyTorch's function, not the diversion."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from deferinit import deferred_init\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        import torch._dynamo\n"
        "        self.p = torch.nn.Parameter(torch.ones(2))\n"
        "deferred_init(M)\n"
        "from torch._dynamo.trace_rules import _polyfilled_function_ids\n"
        "assert id(torch._C.TensorBase._make_subclass) in _polyfilled_function_ids\n"
        "assert torch.Tensor._make_subclass is torch._C.TensorBase._make_subclass\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_other_threads_make_real_subclasses_while_a_deferral_records():
    import threading

    seen = []
    inside = threading.Event()
    done = threading.Event()

    class Waits(nn.Module):
        def __init__(self):
            super().__init__()
            inside.set()
            done.wait(30)
            self.p = Int8Params(torch.ones(2))

    thread = threading.Thread(target=deferred_init, args=(Waits,))
    thread.start()
    inside.wait(30)
    made = Int8Params(torch.ones(2))
    seen.append(type(made) is Int8Params and not is_fake(made))
    seen.append(type(nn.Parameter(torch.ones(2))) is nn.Parameter)
    done.set()
    thread.join(30)
    assert seen == [True, True]


def test_a_compiled_parameter_subclass_constructor_runs_as_eager_after_fakes_exist():
    """A compiled ``Parameter`` subclass constructor meets what dynamo guarded on,
    compiled before fakes exist, while they are alive and after they died:
    dynamo reads the diversion where it traces as where it guards (a diversion
    that answered PyTorch's own to dynamo's frames failed its guard on the
    same frame)."""
    import gc

    import torch._dynamo

    def f(x):
        return Int8Params(x * 2) + 1

    torch._dynamo.reset()
    try:
        before = torch.compile(f, backend="eager", fullgraph=True)
        assert torch.equal(before(torch.ones(2)), f(torch.ones(2)))
        with fake_mode():
            alive = Int8Params(torch.ones(2))  # fakes (and their subclasses) exist
        during = torch.compile(f, backend="eager", fullgraph=True)
        for compiled in (before, during):
            assert torch.equal(compiled(torch.ones(2)), f(torch.ones(2)))
        del alive
        gc.collect()
        for compiled in (before, during):
            assert torch.equal(compiled(torch.ones(2)), f(torch.ones(2)))
    finally:
        torch._dynamo.reset()
