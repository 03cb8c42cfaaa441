"""The error catalogue (docs/errors.md): every error the toolkit raises while
recording or materializing, its class, what its message names (the operation,
the module being constructed or the tensor being materialized, and what to
do), that the fix it suggests works, and that nothing is left behind.

Each test is named in docs/errors.md next to the error it backs.  The autouse
fixture of conftest.py checks after every test that modes, patches, default
dtype and grad mode are as before; tests/test_state.py checks more.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import deferinit
import deferinit.materialize.evaluate as evaluate
from deferinit import (
    AutogradMaterializationError,
    DataDependentError,
    DeferredInitError,
    DeviceUnavailableError,
    ExternalTensorMutatedError,
    InferenceTensorInputError,
    MaterializationError,
    MixedFakeError,
    RecordingError,
    ReplayError,
    deferred_init,
    is_deferred,
)
from deferinit.fake import FakeDataAccessError, FakeIntoRealError, FakeTensorError, UnsupportedOperatorError, fake_mode, is_fake, meta_like
from helpers import assert_same_tensors
from deferinit.materialize import materialize_module, materialize_tensor


# -- the hierarchy ------------------------------------------------------------


def test_error_hierarchy():
    """One base class to catch them all; recording and materialization apart."""
    for cls in (RecordingError, MaterializationError):
        assert issubclass(cls, DeferredInitError)
    for cls in (MixedFakeError, InferenceTensorInputError, DataDependentError, deferinit.DeferredWriteError):
        assert issubclass(cls, RecordingError)
    assert issubclass(deferinit.DeferredModuleWarning, UserWarning)
    assert issubclass(deferinit.PendingDrawsWarning, UserWarning)
    for cls in (ExternalTensorMutatedError, DeviceUnavailableError, ReplayError, AutogradMaterializationError):
        assert issubclass(cls, MaterializationError)
    assert issubclass(DeferredInitError, RuntimeError)
    assert issubclass(FakeDataAccessError, FakeTensorError) and issubclass(FakeTensorError, RuntimeError)
    # Each class lives beside the layer that raises it; the front door exports them all.
    beside = {
        "deferinit.errors": (
            "DataDependentError", "DeferredInitError", "DeferredModuleWarning", "DeferredWriteError",
            "InferenceTensorInputError", "PendingDrawsWarning", "MaterializationError", "MixedFakeError",
            "RecordingError", "ReplayError", "UnsupportedCallError", "UnsupportedModeError",
        ),
        "deferinit.materialize.errors": (
            "AutogradMaterializationError", "DeviceUnavailableError", "ExternalTensorMutatedError", "FSDP1DeferredModuleError",
        ),
        "deferinit.materialize.checkpoint.errors": (
            "CheckpointError", "CheckpointMismatchError", "CheckpointNotFoundError", "CheckpointReadError",
        ),
    }
    for module, names in beside.items():
        for name in names:
            assert getattr(deferinit, name).__module__ == module and name in deferinit.__all__
    exported = {name for name in deferinit.__all__ if name.endswith(("Error", "Warning"))}
    assert exported == {name for names in beside.values() for name in names}


# -- 1. data access on a random value of an absent device ---------------------


class ReadsCudaValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(3, device="cuda"))
        self.scale = float(self.weight.sum().item())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_item_of_a_random_value_on_an_absent_device():
    before = torch.get_rng_state()
    with pytest.raises(DataDependentError) as info:
        deferred_init(ReadsCudaValue)
    message = str(info.value)
    assert "item()" in message and "ReadsCudaValue" in message and "cuda:0" in message
    assert "device='cpu'" in message  # the fix
    assert "deferred_init(ReadsCudaValue)" in "".join(getattr(info.value, "__notes__", []))
    assert torch.equal(torch.get_rng_state(), before)


class ReadsValue(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(3, device=device))
        self.scale = float(self.weight.sum().item())


def test_item_of_a_random_value_fix_record_on_cpu():
    """The fix: record on a device that exists; the value read is eager's."""
    torch.manual_seed(0)
    eager = ReadsValue("cpu")
    torch.manual_seed(0)
    m = deferred_init(ReadsValue, "cpu")
    assert m.scale == eager.scale
    materialize_module(m)
    assert_same_tensors(eager, m)


class ReadsLargeValue(nn.Module):
    def __init__(self):
        super().__init__()
        table = torch.rand(1000)
        self.total = table.sum().item()


def test_item_over_the_evaluation_limit(monkeypatch):
    monkeypatch.setattr(evaluate, "LIMIT_BYTES", 64)
    with pytest.raises(DataDependentError, match="DEFERINIT_EVAL_LIMIT_BYTES") as info:
        deferred_init(ReadsLargeValue)
    assert "item()" in str(info.value) and "ReadsLargeValue" in str(info.value)
    monkeypatch.setattr(evaluate, "LIMIT_BYTES", 1 << 20)  # the fix: raise the limit
    torch.manual_seed(0)
    eager = ReadsLargeValue()
    torch.manual_seed(0)
    assert deferred_init(ReadsLargeValue).total == eager.total


# -- 2. ops without meta kernels / with data-dependent output shapes ----------


@pytest.mark.parametrize("op,name", [
    (lambda t: t.masked_select(t > 0.5), "aten.masked_select"),
    (lambda t: torch.nonzero(t > 0.5), "aten.nonzero"),
    (lambda t: torch.unique(t), "aten._unique2"),
])
def test_op_without_meta_kernel(op, name):
    """Under fake_mode the values are unknown: an op whose output shape depends
    on them is refused by name (not as a NotImplementedError, which PyTorch and
    user code take for "fall back")."""
    with fake_mode():
        t = torch.rand(6)
        with pytest.raises(UnsupportedOperatorError) as info:
            op(t)
    assert not isinstance(info.value, NotImplementedError) and isinstance(info.value, FakeTensorError)
    message = str(info.value)
    assert name in message and "depends on the data" in message
    assert "meta kernel" in message and "materialize them first" in message


class NoMetaKernel(nn.Module):
    def __init__(self, op):
        super().__init__()
        t = torch.rand(6)
        self.register_buffer("picked", op(t))


def test_op_without_meta_kernel_fix_run_on_real_tensors():
    """The fix: compute such values on real tensors (here: after materialization)."""
    with fake_mode():
        plain = torch.rand(6)
    real = torch.rand(6)
    assert torch.equal(real.masked_select(real > 0.5), real[real > 0.5])
    with pytest.raises(UnsupportedOperatorError):
        plain.masked_select(plain > 0.5)


def test_data_dependent_op_inside_deferred_init_is_computed():
    """Inside deferred_init the values are known: the op is computed as item() is."""
    torch.manual_seed(0)
    eager = NoMetaKernel(lambda t: t.masked_select(t > 0.5))
    torch.manual_seed(0)
    m = deferred_init(NoMetaKernel, lambda t: t.masked_select(t > 0.5))
    materialize_module(m)
    assert torch.equal(m.picked, eager.picked)


def test_data_dependent_op_on_an_absent_device():
    with pytest.raises(DataDependentError, match=r"torch\.masked_select\(\) on a deferred tensor .* cuda:0 does not exist"):
        with torch.device("cuda"):
            deferred_init(NoMetaKernel, lambda t: t.masked_select(t > 0.5))


def test_op_without_meta_kernel_in_fake_mode():
    with pytest.raises(UnsupportedOperatorError, match="cannot run on fake tensors"):
        with fake_mode():
            torch.rand(4).masked_select(torch.ones(4, dtype=torch.bool))


# -- 3. outside tensors mutated after recording -------------------------------


class UsesOutside(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.register_buffer("scaled", table * 2)


def test_outside_tensor_mutated_after_recording():
    table = torch.ones(3)
    m = deferred_init(UsesOutside, table)
    table.add_(1)
    fake = m.scaled
    before = torch.get_rng_state()
    with pytest.raises(ExternalTensorMutatedError) as info:
        materialize_module(m)
    message = str(info.value)
    assert "version 0 -> 1" in message and "(size=(3,)" in message and "clone" in message
    assert "while materializing scaled" in "".join(getattr(info.value, "__notes__", []))
    # nothing changed: still deferred, the same object
    assert m.scaled is fake and is_deferred(m)
    assert torch.equal(torch.get_rng_state(), before)


def test_outside_tensor_mutated_fix_pass_a_clone():
    table = torch.ones(3)
    m = deferred_init(UsesOutside, table.clone())
    table.add_(1)
    materialize_module(m)
    assert torch.equal(m.scaled, torch.full((3,), 2.0))


# -- 4. inference tensors as inputs -------------------------------------------


def test_inference_tensor_as_input():
    with torch.inference_mode():
        table = torch.ones(3)
    with pytest.raises(InferenceTensorInputError) as info:
        deferred_init(UsesOutside, table)
    message = str(info.value)
    assert "aten.mul" in message and "UsesOutside" in message and "inference" in message
    assert "clone()" in message


def test_inference_tensor_fix_clone_outside_inference_mode():
    with torch.inference_mode():
        table = torch.ones(3)
    m = deferred_init(UsesOutside, table.clone())
    materialize_module(m)
    assert torch.equal(m.scaled, torch.full((3,), 2.0))


def test_outside_tensor_subclass_with_its_own_dispatch():
    """An outside wrapper subclass used inside a deferral dispatches as eagerly: its
    own __torch_dispatch__ runs first and computes on its inner tensors, which the
    record reads by reference.  (Replay never reads the wrapper's empty memory,
    which crashed the process; that was refused with a RecordingError before
    deferrals composed with wrapper subclasses.)"""
    from torch.testing._internal.two_tensor import TwoTensor

    table = TwoTensor(torch.ones(3), torch.full((3,), 2.0))
    m = deferred_init(UsesOutside, table)
    assert type(m.scaled) is TwoTensor and is_deferred(m)
    materialize_module(m)
    eager = UsesOutside(table)
    assert type(m.scaled) is TwoTensor and not is_deferred(m)
    assert torch.equal(m.scaled.a, eager.scaled.a) and torch.equal(m.scaled.b, eager.scaled.b)


# -- 5. fakes from fake_mode mixed into deferred_init -------------------------


def test_fake_mode_fake_as_input():
    with fake_mode():
        table = torch.ones(3)
    with pytest.raises(MixedFakeError) as info:
        deferred_init(UsesOutside, table)
    message = str(info.value)
    assert "aten.mul" in message and "UsesOutside" in message and "fake_mode" in message
    assert "inside deferred_init" in message


class AssignsData(nn.Module):
    def __init__(self, data):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))
        self.weight.data = data


def test_fake_mode_fake_assigned_to_data():
    with fake_mode():
        table = torch.ones(3)
    with pytest.raises(MixedFakeError, match="fake_mode"):
        deferred_init(AssignsData, table)


def test_fake_mode_fix_create_inside_deferred_init():
    m = deferred_init(UsesOutside, torch.ones(3))  # a real tensor works
    materialize_module(m)
    assert torch.equal(m.scaled, torch.full((3,), 2.0))


def test_non_tensor_assigned_to_data():
    with pytest.raises(TypeError, match="assign a tensor"):
        deferred_init(AssignsData, 3)


# -- 6. materializing onto a device that does not exist -----------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_materialize_on_absent_recorded_device():
    m = deferred_init(nn.Linear, 2, 3, device="cuda")
    with pytest.raises(DeviceUnavailableError) as info:
        materialize_module(m)
    message = str(info.value)
    assert "weight" in message and "cuda:0" in message and "device='cpu'" in message
    with pytest.raises(DeviceUnavailableError, match="cuda:0"):
        materialize_tensor(m.bias)
    assert is_deferred(m.weight) and is_deferred(m.bias)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "xla:0"])
def test_materialize_on_absent_requested_device(device):
    m = deferred_init(nn.Linear, 2, 3)
    with pytest.raises(DeviceUnavailableError, match="no such device"):
        materialize_module(m, device=device)
    assert is_deferred(m)


def test_materialize_on_absent_device_fix_pass_device():
    torch.manual_seed(0)
    eager = nn.Linear(2, 3)
    torch.manual_seed(0)
    m = deferred_init(nn.Linear, 2, 3, device="cuda")
    materialize_module(m, device="cpu")
    assert_same_tensors(eager, m)


# -- 7. a constructor that raises ---------------------------------------------


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(3))
        nn.init.trunc_normal_(self.weight)
        raise KeyError("boom")


def test_constructor_raises():
    before = torch.get_rng_state()
    with pytest.raises(KeyError, match="boom") as info:
        deferred_init(Raises)
    assert info.value.__notes__ == ["(raised inside deferred_init(Raises))"]
    assert torch.equal(torch.get_rng_state(), before)
    from deferinit.session import current_record

    assert current_record() is None


def test_constructor_raises_in_nested_deferred_init():
    def outer():
        return deferred_init(Raises)

    with pytest.raises(KeyError) as info:
        deferred_init(outer)
    # one note, from the outermost call
    assert len(info.value.__notes__) == 1 and "outer" in info.value.__notes__[0]


def test_deferred_init_of_non_callable():
    with pytest.raises(TypeError, match="expects a callable, got int"):
        deferred_init(3)


# -- 8. is_deferred on non-tensors --------------------------------------------


@pytest.mark.parametrize("obj", [3, None, "weight", [torch.ones(1)], {"w": torch.ones(1)}, nn.ModuleList])
def test_is_deferred_of_non_tensor(obj):
    with pytest.raises(ValueError, match="expects a tensor or an nn.Module, got"):
        is_deferred(obj)


def test_is_deferred_of_tensors_and_modules():
    m = deferred_init(nn.Linear, 2, 2)
    with fake_mode():
        plain = torch.ones(2)
    assert is_deferred(m) and is_deferred(m.weight)
    assert not is_deferred(torch.ones(1)) and not is_deferred(plain) and not is_deferred(nn.ReLU())


# -- replay failures and data access ------------------------------------------


class IndexOutOfRange(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("ok", torch.rand(2))
        self.register_buffer("bad", torch.zeros(3).index_fill_(0, torch.tensor([10]), 1.0))


def test_replay_error_leaves_module_deferred():
    """Meta kernels do not check index values: eager raises at construction,
    deferred at materialization, with the op, node and tensor named."""
    with pytest.raises(IndexError):
        IndexOutOfRange()
    m = deferred_init(IndexOutOfRange)
    fakes = (m.ok, m.bad)
    before = torch.get_rng_state()
    with pytest.raises(ReplayError) as info:
        materialize_module(m)
    message = str(info.value)
    assert "aten.index_fill_" in message and "bad" in message and "IndexError" in message
    assert "Nothing was changed" in message
    assert (m.ok, m.bad) == fakes and is_deferred(m.ok) and is_deferred(m.bad)
    assert torch.equal(torch.get_rng_state(), before)
    # the tensors that do not need the failing op still materialize
    materialize_tensor(m.ok)
    assert not is_fake(m.ok)


def test_data_access_on_plain_fake():
    with fake_mode():
        t = torch.empty(3)  # no value to know (torch.ones(3) would keep its value: fake.md, known values)
        s = t.sum()  # its value depends on t's, which is unknown
    for action, op in [(t.tolist, "tolist()"), (s.item, "item()"), (t.data_ptr, "data_ptr()"),
                       (t.untyped_storage().tolist, "UntypedStorage.tolist()"), (t.numpy, "numpy()"),
                       (lambda: bool(s), "bool()"), (lambda: int(s), "int()"), (lambda: float(s), "float()")]:
        with pytest.raises(FakeDataAccessError, match=op.replace("(", r"\(").replace(")", r"\)")) as info:
            action()
        assert info.value.operation == op
        assert "(size=" in str(info.value)


def test_data_access_on_deferred_fake_without_value():
    """A deferred fake computes item()/tolist() (see evaluate.py), but has no
    memory while it is being recorded; asked for its address after
    construction it becomes real (materialize/test_holders.py)."""
    m = deferred_init(nn.Linear, 2, 2)
    assert len(m.weight.tolist()) == 2 and is_deferred(m.weight)

    def asks_address():
        t = torch.ones(2)
        t.data_ptr()

    with pytest.raises(FakeDataAccessError, match=r"no memory, hence no address \(while constructing"):
        deferred_init(asks_address)
    if not torch.cuda.is_available():  # recorded for a device this process lacks: no memory to give
        w = deferred_init(nn.Linear, 2, 2, device="cuda").weight
        with pytest.raises(FakeDataAccessError, match=r"no memory, hence no address") as info:
            w.data_ptr()
        assert "device='cuda:0'" in str(info.value) and is_deferred(w)
    with pytest.raises(FakeDataAccessError, match="pickling"):
        copy.copy(m.weight)


def test_saving_a_deferred_model_says_materialize_first(tmp_path):
    """safetensors' save_file and transformers' save_pretrained ask a deferred model's
    tensors for their memory (a typed storage, an address): the message says why
    that fails and to materialize first, and the fix saves eager's values."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=64)
    torch.manual_seed(0)
    llama = deferred_init(LlamaForCausalLM, config)
    linear = deferred_init(nn.Linear, 4, 3)
    for save in (lambda: save_file(linear.state_dict(), tmp_path / "l.safetensors"),
                 lambda: llama.save_pretrained(tmp_path / "llama")):
        with pytest.raises(FakeDataAccessError) as info:
            save()
        message = str(info.value)
        assert "Saving a tensor (safetensors' save_file, save_pretrained, torch.save) needs its bytes" in message
        assert "Materialize it first (materialize_module(model)" in message
        assert "deprecated" not in message
    with fake_mode():
        plain = torch.empty(3)
    with pytest.raises(FakeDataAccessError, match="A fake from fake_mode has no values to save"):
        save_file({"t": plain}, tmp_path / "p.safetensors")
    materialize_module(llama)
    llama.save_pretrained(tmp_path / "llama")
    torch.manual_seed(0)
    eager = LlamaForCausalLM(config)
    saved = load_file(tmp_path / "llama" / "model.safetensors")
    assert len(saved) >= 8
    for name, t in eager.state_dict().items():
        if name in saved:
            assert torch.equal(saved[name], t), name


def test_writing_fake_data_into_real_tensor():
    outside = torch.zeros(3)

    def writes_outside():
        w = nn.Parameter(torch.rand(3))
        with torch.no_grad():
            outside.add_(w)
        return w

    class AccumulatesIntoGlobal(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = writes_outside()

    with pytest.raises(FakeIntoRealError, match="would write fake data into a real tensor") as info:
        deferred_init(AccumulatesIntoGlobal)
    assert "aten.add_" in str(info.value) and "while constructing AccumulatesIntoGlobal" in str(info.value)
    assert torch.equal(outside, torch.zeros(3))


def test_mixed_devices_in_one_op():
    """As eager: tensors on two devices in one op."""
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        deferred_init(lambda: torch.ones(2, device="cuda") + torch.ones(2))


def test_meta_like_of_real_tensor():
    with pytest.raises(ValueError, match="expects a fake tensor"):
        meta_like(torch.ones(1))
