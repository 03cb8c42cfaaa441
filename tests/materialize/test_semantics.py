"""What materialization promises besides the values (issue 4): identity,
in-place swapping, device remapping, inference-mode semantics, all or nothing,
memory release."""

import gc
import weakref

import pytest
import torch
import torch.nn as nn

from deferinit import (
    DeviceUnavailableError,
    ExternalTensorMutatedError,
    MaterializationError,
    RecordingError,
    ReplayError,
    deferred_init,
    is_deferred,
)
from deferinit.fake import fake_mode, is_fake
from helpers import assert_same_tensors, eager_and_deferred, named_tensors
from deferinit.materialize import materialize_module, materialize_tensor

CUDA_MISSING = not torch.cuda.is_available()


# -- materialize_tensor ---------------------------------------------------------------------


def test_real_and_plain_fake_tensors_come_back_as_they_are():
    real = torch.ones(2)
    assert materialize_tensor(real) is real
    with fake_mode():
        plain = torch.ones(2)
    assert materialize_tensor(plain) is plain and is_fake(plain)


def test_in_place_every_reference_sees_the_real_tensor():
    torch.manual_seed(0)
    eager = nn.Linear(3, 3)
    torch.manual_seed(0)
    m = deferred_init(nn.Linear, 3, 3)
    weight = m.weight
    optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
    alias_module = nn.Module()
    alias_module.w = m.weight
    result = materialize_tensor(weight)
    assert result is weight is m.weight is alias_module.w
    assert optimizer.param_groups[0]["params"][0] is weight
    assert type(weight) is nn.Parameter and not is_fake(weight)
    assert torch.equal(weight, eager.weight)
    assert materialize_tensor(weight) is weight  # again: a no-op
    assert is_deferred(m.bias)


def test_materialize_module_returns_the_module_and_is_idempotent():
    m = deferred_init(nn.Transformer, 16, 2, 1, 1, 32)
    before = {name: id(t) for name, t in named_tensors(m).items()}
    assert materialize_module(m) is m
    assert not is_deferred(m)
    after = {name: id(t) for name, t in named_tensors(m).items()}
    assert before == after  # the same objects, now real
    snapshot = {k: v.clone() for k, v in m.state_dict().items()}
    assert materialize_module(m) is m
    assert all(torch.equal(snapshot[k], v) for k, v in m.state_dict().items())


def test_check_fn_and_buffers_only():
    eager, m = eager_and_deferred(lambda: nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2)))
    materialize_module(m, buffers_only=True)
    assert is_deferred(m[0].weight) and not is_deferred(m[1].running_mean) and is_deferred(m[1].weight)
    materialize_module(m, check_fn=lambda sub: isinstance(sub, nn.Linear))
    assert not is_deferred(m[0].weight) and not is_deferred(m[2].bias) and is_deferred(m[1].weight)
    materialize_module(m)
    assert not is_deferred(m)
    assert_same_tensors(eager, m)


# -- identity -----------------------------------------------------------------------------------


class Tagged(nn.Parameter):
    pass


def test_parameter_classes_attributes_and_structure_are_kept():
    def ctor():
        m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        m[0].weight._is_hf_initialized = True
        m[1].weight = Tagged(torch.randn(2, 2))
        m[1].weight.note = "kept"
        m[1].bias = m[0].bias  # a tie
        return m

    eager, m = eager_and_deferred(ctor)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert m[0].weight._is_hf_initialized is True
    assert type(m[1].weight) is Tagged and m[1].weight.note == "kept"
    assert m[1].bias is m[0].bias
    assert "_record" not in m[0].weight.__dict__ and "_shadow" not in m[0].weight.__dict__


# -- devices --------------------------------------------------------------------------------------


def test_record_for_cuda_materialize_on_cpu():
    torch.manual_seed(0)
    eager = nn.Transformer(16, 2, 1, 1, 32)
    torch.manual_seed(0)
    m = deferred_init(nn.Transformer, 16, 2, 1, 1, 32, device="cuda")
    assert m.encoder.layers[0].linear1.weight.is_cuda
    materialize_module(m, device="cpu")
    assert all(t.device.type == "cpu" for t in named_tensors(m).values())
    assert_same_tensors(eager, m)


def test_code_that_branched_on_the_device_keeps_its_branch():
    def ctor(device):
        m = nn.Module()
        x = torch.ones(2, device=device)
        m.register_buffer("x", x if x.is_cuda else x + 1)
        return m

    m = deferred_init(ctor, "cuda")
    materialize_module(m, device="cpu")
    assert m.x.tolist() == [1.0, 1.0]  # the cuda branch, as recorded


@pytest.mark.skipif(not CUDA_MISSING, reason="needs a machine without CUDA")
def test_materializing_on_a_missing_device_is_a_clear_error_and_changes_nothing():
    m = deferred_init(nn.Linear, 2, 2, device="cuda")
    with pytest.raises(DeviceUnavailableError, match=r"weight.*cuda:0.*device='cpu'"):
        materialize_module(m)
    assert is_deferred(m.weight) and is_deferred(m.bias)
    materialize_module(m, device="cpu")
    assert not is_deferred(m)


@pytest.mark.skipif(CUDA_MISSING, reason="needs CUDA")
def test_cuda_materialization_equals_eager_cuda():
    torch.manual_seed(0)
    eager = nn.Transformer(16, 2, 1, 1, 32, device="cuda")
    torch.manual_seed(0)
    m = deferred_init(nn.Transformer, 16, 2, 1, 1, 32, device="cuda")
    materialize_module(m)
    assert_same_tensors(eager, m)


# -- views and mutation ------------------------------------------------------------------------------


class ViewsOfOneBase(nn.Module):
    def __init__(self):
        super().__init__()
        base = torch.zeros(4, 4)
        self.register_buffer("row", base[1])
        self.register_buffer("col", base[:, 2])
        base.add_(torch.arange(16.0).view(4, 4))
        self.register_buffer("base", base)
        base[0].mul_(-1)


@pytest.mark.parametrize("order", [["row", "base", "col"], ["col", "row", "base"], ["base", "row", "col"]])
def test_views_and_bases_materialized_at_different_times_alias(order):
    eager = ViewsOfOneBase()
    m = deferred_init(ViewsOfOneBase)
    for name in order:
        materialize_tensor(getattr(m, name))
    assert_same_tensors(eager, m)
    # really aliased: a write through one is seen through the others
    m.base.fill_(7)
    assert m.row.tolist() == [7.0] * 4 and m.col.tolist() == [7.0] * 4
    assert m.row.untyped_storage().data_ptr() == m.base.untyped_storage().data_ptr()


def test_view_materialized_before_later_in_place_ops_on_its_base():
    def ctor():
        m = nn.Module()
        base = torch.ones(2, 2)
        m.register_buffer("view", base.view(-1))
        base.add_(2)
        m.register_buffer("base", base)
        return m

    m = deferred_init(ctor)
    materialize_tensor(m.view)
    assert m.view.tolist() == [3.0] * 4  # torchdistx gave 1.0 here
    # A write to the still deferred base would reach the real view only when
    # the base is materialized, out of order with real writes: refused.
    with pytest.raises(RecordingError, match="already materialized"):
        m.base.mul_(2)
    materialize_tensor(m.base)
    m.base.mul_(2)
    assert m.view.tolist() == [6.0] * 4 and m.base.tolist() == [[6.0, 6.0], [6.0, 6.0]]


# -- inference-mode semantics -----------------------------------------------------------------------


def test_default_results_are_normal_trainable_leaves():
    eager, m = eager_and_deferred(lambda: nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    materialize_module(m)
    for name, t in named_tensors(m).items():
        assert t.is_leaf and not t.is_inference() and t.grad_fn is None, name
        assert t.requires_grad == named_tensors(eager)[name].requires_grad, name
    m.train()
    loss = m(torch.randn(4, 3)).sum()
    loss.backward()
    torch.optim.Adam(m.parameters()).step()
    assert m[0].weight.grad is not None


def test_inference_true_gives_inference_tensors():
    eager, m = eager_and_deferred(lambda: nn.Linear(3, 3))
    materialize_module(m, inference=True)
    assert m.weight.is_inference() and m.bias.is_inference()
    assert type(m.weight) is nn.Parameter
    assert torch.equal(m.weight, eager.weight)
    with torch.inference_mode():
        out = m(torch.ones(1, 3))
    assert torch.equal(out, eager(torch.ones(1, 3)).detach())


# -- all or nothing ------------------------------------------------------------------------------------


def test_outside_tensor_mutated_since_recording():
    outside = torch.ones(3)

    def ctor():
        m = nn.Linear(3, 3)
        m.register_buffer("scaled", outside * 2)
        return m

    m = deferred_init(ctor)
    outside.add_(1)
    with pytest.raises(ExternalTensorMutatedError, match=r"modified in place.*version"):
        materialize_module(m)
    assert all(is_deferred(t) for t in named_tensors(m).values())  # nothing changed


def test_failing_op_leaves_the_module_deferred_and_usable():
    class Fragile(nn.Module):
        def __init__(self, bad):
            super().__init__()
            self.ok = nn.Linear(2, 2)
            self.register_buffer("x", torch.ones(2))
            self.register_buffer("y", self.x[bad] * 2)

    index = torch.tensor([0, 1])
    m = deferred_init(Fragile, index)
    index[1] = 5  # out of range at replay, and a mutation of an outside tensor
    with pytest.raises(MaterializationError):
        materialize_module(m)
    assert all(is_deferred(t) for t in named_tensors(m).values())
    materialize_module(m.ok)  # the rest still materializes
    assert not is_deferred(m.ok)


def test_replay_error_names_the_op_and_tensor(monkeypatch):
    m = deferred_init(nn.Linear, 2, 2)
    from deferinit.materialize import draws

    original = draws.Draws.call

    def failing(self, node, *args):
        if node.kind == "op" and node.target._opname == "uniform_":
            raise RuntimeError("simulated out of memory")
        return original(self, node, *args)

    monkeypatch.setattr(draws.Draws, "call", failing)
    with pytest.raises(ReplayError, match=r"aten\.uniform_.*weight.*simulated out of memory.*Nothing was changed"):
        materialize_module(m)
    assert is_deferred(m.weight) and is_deferred(m.bias)


# -- memory ---------------------------------------------------------------------------------------------


def test_record_is_released_once_nothing_deferred_needs_it():
    m = deferred_init(nn.Transformer, 16, 2, 1, 1, 32)
    record = weakref.ref(m.encoder.layers[0].linear1.weight._record)
    materialize_module(m)
    gc.collect()
    assert record() is None


def test_partially_materialized_record_stays_for_the_rest():
    m = deferred_init(nn.Linear, 2, 2)
    record = weakref.ref(m.weight._record)
    materialize_tensor(m.weight)
    gc.collect()
    assert record() is not None  # the bias still needs it
    materialize_tensor(m.bias)
    gc.collect()
    assert record() is None


def test_materializing_on_meta_is_refused():
    m = deferred_init(nn.Linear, 2, 2)
    with pytest.raises(ValueError, match=r"weight on the meta device.*meta_like"):
        materialize_module(m, device="meta")
    assert is_deferred(m.weight) and is_deferred(m.bias)
