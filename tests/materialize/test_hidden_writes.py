"""Writes a kernel makes without its schema saying so (``deferinit.fake.opinfo.HIDDEN_WRITES``):
batch norm in training mode updates the running statistics it takes as plain
``Tensor?``.  Recorded as writes, they are replayed in order; compared with
eager PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from deferinit import deferred_init, is_deferred
from deferinit.fake import FakeIntoRealError, fake_mode
from deferinit.fake.opinfo import HIDDEN_WRITES, op_info
from helpers import assert_same_tensors, eager_and_deferred, materialize_in_order
from deferinit.materialize import materialize_module, materialize_tensor

aten = torch.ops.aten


def _bn_args(func, rm, rv, training):
    x = torch.randn(8, 4)
    if func in (aten.native_batch_norm.default, aten.native_batch_norm.out):
        args = (x, None, None, rm, rv, training, 0.1, 1e-5)
        if func is aten.native_batch_norm.out:
            return args, {"out": torch.empty(0), "save_mean": torch.empty(0), "save_invstd": torch.empty(0)}
        return args, {}
    args = (x, rm, rv, 0.1)
    if func is aten.batch_norm_update_stats.out:
        return args, {"out0": torch.empty(0), "out1": torch.empty(0)}
    return args, {}


CPU_HIDDEN = [aten.native_batch_norm.default, aten.native_batch_norm.out,
              aten.batch_norm_update_stats.default, aten.batch_norm_update_stats.out]


@pytest.mark.parametrize("func", CPU_HIDDEN, ids=str)
@pytest.mark.parametrize("training", [True, False])
def test_hidden_writes_are_what_the_cpu_kernel_writes(func, training):
    """The list declares exactly what the kernel writes (a write never made would
    refuse eval-mode forwards on deferred modules; a write missed loses values)."""
    assert func in HIDDEN_WRITES
    rm, rv = torch.zeros(4), torch.ones(4)
    args, kwargs = _bn_args(func, rm, rv, training)
    declared = op_info(func).written(args, kwargs)
    func(*args, **kwargs)
    written = not torch.equal(rm, torch.zeros(4)) or not torch.equal(rv, torch.ones(4))
    schema_writes = [t for t in declared if any(t is v for v in kwargs.values())]
    hidden = [t for t in declared if t is rm or t is rv]
    assert written == bool(hidden), (written, len(hidden))
    assert len(schema_writes) == len(kwargs)
    if written:
        assert hidden[0] is rm and hidden[1] is rv


def test_only_batch_norm_hides_writes():
    """The overloads listed all take running statistics (the scan of
    tools/scan_hidden_writes.py found nothing else on CPU)."""
    for func, (positions, _) in HIDDEN_WRITES.items():
        names = [func._schema.arguments[p].name for p in positions]
        assert names == ["running_mean", "running_var"], func


class NormInConstructor(nn.Module):
    """Runs a normalisation module forward in training mode inside ``__init__``."""

    def __init__(self, make, shape, forwards=1, keep_output=False):
        super().__init__()
        self.norm = make()
        self.norm.train()
        for _ in range(forwards):
            out = self.norm(torch.randn(*shape))
        if keep_output:
            self.register_buffer("out", out.detach())


NORMS = {
    "BatchNorm1d": (lambda: nn.BatchNorm1d(4), (8, 4)),
    "BatchNorm1d 3d input": (lambda: nn.BatchNorm1d(4), (8, 4, 5)),
    "BatchNorm1d momentum=None": (lambda: nn.BatchNorm1d(4, momentum=None), (8, 4)),
    "BatchNorm1d affine=False": (lambda: nn.BatchNorm1d(4, affine=False, momentum=0.3), (6, 4)),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), (2, 3, 4, 4)),
    "BatchNorm3d": (lambda: nn.BatchNorm3d(2), (2, 2, 3, 3, 3)),
    "InstanceNorm1d tracked": (lambda: nn.InstanceNorm1d(4, track_running_stats=True), (2, 4, 5)),
    "InstanceNorm2d tracked affine": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (2, 3, 4, 4)),
    "InstanceNorm3d tracked momentum=None": (
        lambda: nn.InstanceNorm3d(2, track_running_stats=True, momentum=None), (2, 2, 3, 3, 3)),
    "Linear then BatchNorm1d": (lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), (8, 3)),
}


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("forwards", [1, 3])
def test_training_forward_in_constructor(name, forwards):
    make, shape = NORMS[name]
    eager, m = eager_and_deferred(NormInConstructor, make, shape, forwards)
    materialize_module(m)
    assert_same_tensors(eager, m)


@pytest.mark.parametrize("order", ["forward", "reverse", 3])
def test_training_forward_in_constructor_any_order(order):
    make, shape = NORMS["BatchNorm2d"]
    eager, m = eager_and_deferred(NormInConstructor, make, shape, 2, keep_output=True)
    materialize_in_order(m, order)
    assert_same_tensors(eager, m)


def test_eval_forward_in_constructor_writes_nothing():
    def make():
        bn = nn.BatchNorm1d(4)
        bn.running_mean.fill_(0.5)
        bn.eval()
        return bn

    eager, m = eager_and_deferred(NormInConstructor, make, (8, 4), 1, keep_output=True)
    m.norm.eval()
    materialize_module(m)
    eager.norm.eval()
    assert_same_tensors(eager, m)


class FunctionalBatchNorm(nn.Module):
    def __init__(self, momentum, how):
        super().__init__()
        self.register_buffer("rm", torch.zeros(4))
        self.register_buffer("rv", torch.ones(4))
        self.register_buffer("view_of_rm", self.rm[1:3])
        for _ in range(2):
            x = torch.randn(8, 4, 3) * 3 + 1
            if how == "F.batch_norm":
                F.batch_norm(x, self.rm, self.rv, training=True, momentum=momentum)
            elif how == "torch.batch_norm":
                torch.batch_norm(x, None, None, self.rm, self.rv, True, momentum, 1e-5, False)
            else:
                F.instance_norm(x, self.rm, self.rv, use_input_stats=True, momentum=momentum)
        self.register_buffer("snapshot", self.rm.clone())


@pytest.mark.parametrize("momentum", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("how", ["F.batch_norm", "torch.batch_norm", "F.instance_norm"])
def test_functional_batch_norm_on_own_buffers(momentum, how):
    """The writes land on the buffers, their views, and on what is read after them."""
    eager, m = eager_and_deferred(FunctionalBatchNorm, momentum, how)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert m.view_of_rm.untyped_storage().data_ptr() == m.rm.untyped_storage().data_ptr()


def test_batch_norm_on_deferred_buffers_after_construction():
    """The op called directly on deferred tensors (outside any forward) extends the record."""
    torch.manual_seed(1)
    x = torch.randn(8, 4)
    eager, m = eager_and_deferred(nn.BatchNorm1d, 4)
    for module in (eager, m):
        F.batch_norm(x, module.running_mean, module.running_var, module.weight, module.bias, training=True, momentum=0.2)
    assert is_deferred(m.running_mean)
    materialize_tensor(m.running_var)
    materialize_module(m)
    assert_same_tensors(eager, m)


def test_real_running_stats_with_fake_input_are_refused():
    """A training forward of a real BatchNorm on a fake input would write fake
    data into the real running statistics: refused, not silently skipped."""
    bn = nn.BatchNorm1d(4)
    before = bn.running_mean.clone()
    with fake_mode():
        x = torch.randn(8, 4)
        with pytest.raises(FakeIntoRealError, match="native_batch_norm"):
            bn(x)
    assert torch.equal(bn.running_mean, before)
