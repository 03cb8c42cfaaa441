"""Other holders of a deferred model's tensors: TorchScript, accelerate's offload
hooks, shared memory, dynamic quantization, and objects of the user's own.

Each flow either works as on the eager model (compared with the same flow
run eagerly: values, ties, the generator afterwards) or raises the
project's error naming the call and the fix, and ``is_deferred`` never
says False while a tensor reachable from the module is fake.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

from deferinit import UnsupportedCallError, deferred, is_deferred
from deferinit.fake import FakeDataAccessError, FakeIntoRealError, is_fake
from deferinit.materialize import materialize_module

from helpers import assert_same_tensors


def _net():
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))


def _built(defer, build=_net):
    torch.manual_seed(0)
    if not defer:
        return build()
    with deferred():
        return build()


X = torch.linspace(-1, 1, 12).reshape(2, 6)


# -- TorchScript -----------------------------------------------------------------------------


def test_a_scripted_deferred_model_materializes_as_the_eager_scripted_one():
    eager = torch.jit.script(_built(False)).eval()
    after_eager = torch.rand(8)
    model = _built(True)
    scripted = torch.jit.script(model)
    assert is_deferred(scripted)
    materialize_module(scripted)
    after = torch.rand(8)
    assert not is_deferred(scripted) and not is_deferred(model)
    assert_same_tensors(eager, scripted)
    assert torch.equal(scripted.eval()(X), eager(X))
    assert torch.equal(after, after_eager)
    # eagerly the script module shares the module's tensors: still so
    assert all(a is b for a, b in zip(scripted.parameters(), model.parameters()))


def test_materializing_the_module_a_script_was_made_from_leaves_the_script_deferred():
    """TorchScript's C++ slots are not reachable from the Python module; the
    script module then still says it is deferred, and materializes on its own."""
    eager = torch.jit.script(_built(False)).eval()
    model = _built(True)
    scripted = torch.jit.script(model)
    materialize_module(model)
    assert is_deferred(scripted)  # never "done" while its tensors are fake
    materialize_module(scripted)
    assert not is_deferred(scripted)
    assert torch.equal(scripted.eval()(X), eager(X))


def _trace_refusal(model, check_trace) -> str:
    """The message of the refused trace; the exception itself is dropped, as a
    program that catches it drops it (it holds TorchScript's tracer state,
    whose references to the parameters would make swapping them in fail)."""
    try:
        torch.jit.trace(model, X, check_trace=check_trace)
    except UnsupportedCallError as e:
        return str(e)
    raise AssertionError("torch.jit.trace of a deferred model was not refused")


@pytest.mark.parametrize("check_trace", [True, False])
def test_tracing_a_deferred_model_is_refused_and_changes_nothing(check_trace):
    eager = _built(False)
    after_eager = torch.rand(8)
    model = _built(True)
    message = _trace_refusal(model, check_trace)
    assert re.search(r"torch\.jit\._trace\.trace \(called at test_holders\.py:\d+\)", message)
    assert "materialize_module(model)), then trace it" in message
    materialize_module(model)
    assert_same_tensors(eager, model)
    assert torch.equal(torch.rand(8), after_eager)
    traced = torch.jit.trace(model.eval(), X)  # the fix
    assert torch.equal(traced(X), eager.eval()(X))


# -- objects that keep a module's tensors ----------------------------------------------------


class Keeper:
    """A hook-like object of the test's own: nested objects, slots, a closure."""

    def __init__(self, tensors):
        self.inner = types_namespace(maps=[{"w": tensors[0]}])
        self.slotted = Slotted(tensors[1])
        self.read = (lambda: tensors[2])


class Slotted:
    __slots__ = ("__kept",)

    def __init__(self, t):
        self.__kept = t


def types_namespace(**kwargs):
    import types

    return types.SimpleNamespace(**kwargs)


def _kept(defer):
    torch.manual_seed(0)

    def build():
        layer = nn.Linear(3, 3)
        layer.keeper = Keeper([torch.randn(2), torch.rand(3), torch.ones(4) * 2])
        layer.forward = functools.partial(lambda x, extra: x + extra, extra=torch.randn(3))
        return layer

    if not defer:
        return build()
    with deferred():
        return build()


def _kept_tensors(layer):
    return [
        layer.keeper.inner.maps[0]["w"], layer.keeper.slotted._Slotted__kept,
        layer.keeper.read(), layer.forward.keywords["extra"],
    ]


def test_tensors_other_objects_keep_are_deferred_and_materialized():
    eager = _kept(False)
    after_eager = torch.rand(8)
    model = _kept(True)
    assert is_deferred(model)
    # only what other objects keep: the module's own tensors made real first
    for p in model.parameters():
        from deferinit.materialize import materialize_tensor

        materialize_tensor(p)
    assert is_deferred(model), "is_deferred said False while tensors the module keeps are fake"
    materialize_module(model)
    assert not is_deferred(model)
    for a, b in zip(_kept_tensors(eager), _kept_tensors(model)):
        assert not is_fake(b) and torch.equal(a, b)
    assert torch.equal(torch.rand(8), after_eager)


accelerate = pytest.importorskip("accelerate")


def test_accelerate_cpu_offload_of_a_deferred_model_works_as_eagerly():
    """cpu_offload moves the parameters to meta and keeps the weights in its
    hooks' maps: before, materialize_module found nothing and the forward
    computed on fakes."""
    eager = _built(False)
    accelerate.cpu_offload(eager, execution_device="cpu")
    after_eager = torch.rand(8)
    model = _built(True)
    accelerate.cpu_offload(model, execution_device="cpu")
    assert is_deferred(model)
    materialize_module(model)
    assert not is_deferred(model)
    assert torch.equal(torch.rand(8), after_eager)
    out = model.eval()(X)
    assert not is_fake(out) and torch.equal(out, eager.eval()(X))


def _module_state(model):
    """What each module holds, by identity: its __dict__ (hooks, a forward put in
    place), parameters and buffers."""
    return {
        name: ({k: id(v) for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")},
               {k: id(v) for k, v in m._parameters.items()}, {k: id(v) for k, v in m._buffers.items()})
        for name, m in model.named_modules()
    }


def test_accelerate_disk_offload_of_a_deferred_model_works_as_eagerly(tmp_path):
    """disk_offload writes each weight's values under offload_dir (numpy() of a
    deferred tensor computes them), moves the parameters to meta and reads the
    files back in each forward: the files hold eager's bytes, the buffers left
    on the module materialize, and the generator afterwards is eager's."""
    eager = _built(False)
    accelerate.disk_offload(eager, str(tmp_path / "eager"), execution_device="cpu")
    after_eager = torch.rand(8)
    model = _built(True)
    accelerate.disk_offload(model, str(tmp_path / "deferred"), execution_device="cpu")
    assert is_deferred(model)  # the BatchNorm buffers stay on the module, deferred
    files = sorted(p.name for p in (tmp_path / "eager").iterdir())
    assert sorted(p.name for p in (tmp_path / "deferred").iterdir()) == files
    for name in files:
        assert (tmp_path / "deferred" / name).read_bytes() == (tmp_path / "eager" / name).read_bytes(), name
    materialize_module(model)
    assert not is_deferred(model)
    assert torch.equal(torch.rand(8), after_eager)
    out = model.eval()(X)
    assert not is_fake(out) and torch.equal(out, eager.eval()(X))


def _tied():
    net = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
    net[2].weight = net[0].weight
    return net


# dispatch_model with hooks asks parameters for their data_ptr() (its map of
# tied weights: big_modeling.py before any hook when weights are tied,
# set_module_tensor_to_device in each hook's init_hook otherwise, after
# add_hook_to_module has set _old_forward).  Before, a deferred tensor refused
# it from inside the call, with the modules half hooked; now the tensor asked
# becomes real, as it is eagerly.
_DISPATCHES = {
    "a disk entry": (_net, dict(device_map={"0": "cpu", "1": "cpu", "2": "cpu", "3": "disk"})),
    "force_hooks": (_net, dict(device_map={"": "cpu"}, force_hooks=True)),
    "tied weights and a disk entry": (_tied, dict(device_map={"0": "cpu", "1": "cpu", "2": "disk"})),
}


def _dispatched(model):
    """What a dispatched module holds: each tensor's class, device and values
    (meta: shape), which are tied, and the hook on each module."""
    tensors = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        tensors[name] = (type(t), t.device, t.shape if t.is_meta else t.detach().clone())
    ties = sorted(a for a, t in model.named_parameters(remove_duplicate=False)
                  for b, u in model.named_parameters(remove_duplicate=False) if a < b and t is u)
    hooks = {name: repr(getattr(m, "_hf_hook", None)) for name, m in model.named_modules()}
    return tensors, ties, hooks


@pytest.mark.parametrize("dispatch", list(_DISPATCHES))
def test_accelerate_dispatch_model_of_a_deferred_model_works_as_eagerly(tmp_path, dispatch):
    build, kwargs = _DISPATCHES[dispatch]
    eager = _built(False, build)
    accelerate.dispatch_model(eager, offload_dir=str(tmp_path / "eager"), **kwargs)
    after_eager = torch.rand(8)
    model = _built(True, build)
    accelerate.dispatch_model(model, offload_dir=str(tmp_path / "deferred"), **kwargs)
    materialize_module(model)  # what the hooks did not ask for (nothing here), as for any deferred model
    assert not is_deferred(model)
    assert torch.equal(torch.rand(8), after_eager)
    (tensors, ties, hooks), (eager_tensors, eager_ties, eager_hooks) = _dispatched(model), _dispatched(eager)
    assert ties == eager_ties and hooks == eager_hooks and tensors.keys() == eager_tensors.keys()
    for name, (cls, device, value) in tensors.items():
        eager_cls, eager_device, eager_value = eager_tensors[name]
        assert (cls, device) == (eager_cls, eager_device), name
        assert (value == eager_value) if device.type == "meta" else torch.equal(value, eager_value), name
    if (tmp_path / "eager").exists():  # the "disk" modules' weights: eager's bytes
        files = sorted(p.name for p in (tmp_path / "eager").iterdir())
        assert sorted(p.name for p in (tmp_path / "deferred").iterdir()) == files
        for name in files:
            assert (tmp_path / "deferred" / name).read_bytes() == (tmp_path / "eager" / name).read_bytes(), name
    out = model.eval()(X)
    assert not is_fake(out) and torch.equal(out, eager.eval()(X))


def test_data_ptr_makes_a_deferred_tensor_real_as_eagerly():
    """The mechanism under dispatch_model: asked for its address after
    construction, a deferred tensor becomes real in place (eager's values,
    ties kept); the others stay deferred, and the generator after materializing is eager's."""
    eager = _built(False, _tied)
    after_eager = torch.rand(8)
    model = _built(True, _tied)
    weight = model[0].weight
    address = weight.data_ptr()
    assert weight is model[0].weight and type(weight) is nn.Parameter and not is_fake(weight)
    assert address == weight.data_ptr() == model[2].weight.data_ptr()  # tied: one tensor
    assert is_deferred(model) and is_fake(model[0].bias)
    assert torch.equal(weight, eager[0].weight)
    materialize_module(model)
    assert torch.equal(torch.rand(8), after_eager)
    assert_same_tensors(eager, model)
    assert model[0].weight.data_ptr() == address  # materializing the rest keeps its memory


# -- shared memory, dynamic quantization --------------------------------------------------------


def test_share_memory_of_a_deferred_model_shares_its_real_memory():
    eager = _built(False).share_memory()
    after_eager = torch.rand(8)
    model = _built(True)
    assert model.share_memory() is model
    assert all(t.is_shared() for t in model.state_dict().values())
    materialize_module(model)
    assert all(t.is_shared() and not is_fake(t) for t in model.state_dict().values())
    assert_same_tensors(eager, model)
    assert torch.equal(torch.rand(8), after_eager)


def test_share_memory_of_plain_fakes_says_there_is_no_memory():
    from deferinit.fake import fake_mode

    with fake_mode():
        t = torch.ones(3)
    with pytest.raises(FakeDataAccessError, match="no memory to share"):
        t.share_memory_()
    assert not t.is_shared()


def test_quantize_dynamic_of_a_deferred_model_names_itself_and_the_fix():
    eager = _built(False)
    after_eager = torch.rand(8)
    model = _built(True)
    with pytest.raises(FakeIntoRealError, match=r"inside torch\.ao\.quantization\.quantize\.quantize_dynamic \(called at test_holders") as info:
        torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    assert "materialize_module(model), then call quantize_dynamic" in str(info.value)
    materialize_module(model)  # the model is as it was
    assert_same_tensors(eager, model)
    assert torch.equal(torch.rand(8), after_eager)
    q_eager = torch.ao.quantization.quantize_dynamic(eager.eval(), {nn.Linear}, dtype=torch.qint8)
    q = torch.ao.quantization.quantize_dynamic(model.eval(), {nn.Linear}, dtype=torch.qint8)
    assert torch.equal(q(X), q_eager(X))
