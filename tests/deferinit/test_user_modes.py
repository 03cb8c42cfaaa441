"""A user's torch-function and dispatch modes see inside a deferral what they see eagerly.

Each test runs the same flow twice, eagerly and with ``with deferred():``
(the mode entered outside the block, or inside it), then compares what the
mode saw (every call, in order), the tensors after materialization, and
what the default generator draws next.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.overrides import _get_current_function_mode_stack

from deferinit import UnsupportedModeError, deferred, is_deferred
from deferinit.materialize import materialize_module

from helpers import assert_same_tensors

aten = torch.ops.aten


class CountingFunctions(TorchFunctionMode):
    """Notes every torch function it sees (property reads by the attribute's name)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__qualname__", None) or repr(func)
        if name == "getset_descriptor.__get__":
            name = f"{func.__self__.__name__}.__get__"
        self.seen.append(name)
        return func(*args, **(kwargs or {}))


class LoggingOps(TorchDispatchMode):
    """Notes every ATen operator it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class ReinitFunctions(TorchFunctionMode):
    """Changes what nn.init does: kaiming becomes normal(0, 0.02) (fewer draws
    of another kind), constants become 0.25, and every torch.ones is tripled."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen.append(getattr(func, "__name__", repr(func)))
        if func is nn.init.kaiming_uniform_:
            return nn.init.normal_(kwargs.get("tensor", args[0] if args else None), 0.0, 0.02)
        if func in (nn.init.zeros_, nn.init.ones_, nn.init.constant_):
            tensor = kwargs.get("tensor", args[0] if args else None)
            with torch.no_grad():
                return tensor.fill_(0.25)
        if func is torch.ones:
            return func(*args, **kwargs) * 3
        return func(*args, **kwargs)


class ChangingOps(TorchDispatchMode):
    """Changes operators: uniform_ draws from (-0.01, 0.01), normal_'s result is
    halved, fill_ writes 0.5 instead of its value."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seen.append(str(func))
        if func is aten.uniform_.default:
            return func(args[0], -0.01, 0.01, **kwargs)
        if func is aten.normal_.default:
            out = func(*args, **kwargs)
            return out.mul_(0.5)
        if func is aten.fill_.Scalar:
            return func(args[0], 0.5)
        return func(*args, **kwargs)


def _mixed():
    return nn.Sequential(
        nn.Linear(6, 5), nn.LayerNorm(5), nn.Embedding(7, 5), nn.Conv2d(2, 3, 3), nn.BatchNorm1d(3),
        nn.MultiheadAttention(8, 2), nn.GRU(4, 3),
    )


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=101,
    )
    return transformers.LlamaForCausalLM(config)


def _litgpt():
    model = pytest.importorskip("litgpt.model", reason="litgpt is not installed (make test installs it)")
    return model.GPT(model.Config.from_name("pythia-14m"))


BUILDERS = {"torch.nn": _mixed, "transformers Llama": _tiny_llama, "litgpt pythia-14m": _litgpt}


def _run(mode_class, build, where):
    """Build under a fresh ``mode_class`` from seed 0: eagerly (``where=None``), or
    deferred with the mode entered ``"outside"`` or ``"inside"`` the block."""
    torch.manual_seed(0)
    mode = mode_class()
    if where is None:
        with mode:
            model = build()
    elif where == "outside":
        with mode, deferred():
            model = build()
    else:
        with deferred(), mode:
            model = build()
    if where is not None:
        assert is_deferred(model)
        materialize_module(model)
    return mode.seen, model, torch.rand(8)


@pytest.mark.parametrize("where", ["outside", "inside"])
@pytest.mark.parametrize("mode_class", [CountingFunctions, LoggingOps, ReinitFunctions, ChangingOps])
@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_users_mode_sees_eagers_calls_and_what_it_returns_is_recorded(name, mode_class, where):
    build = BUILDERS[name]
    _run(mode_class, build, None)  # first calls of a library (caches) are not the subject here
    seen_eager, eager, after_eager = _run(mode_class, build, None)
    seen, model, after = _run(mode_class, build, where)
    assert seen == seen_eager, "the mode saw other calls than eagerly"
    assert_same_tensors(eager, model)
    assert torch.equal(after, after_eager), "the generator is not where eager construction leaves it"


def test_a_mode_that_skips_nn_init_leaves_the_generator_where_eager_does():
    """The reported bug: a function mode entered before the block that skips
    nn.init (as Lightning's empty_init does) no longer saw those calls, so the
    block recorded draws eager never made and every later draw shifted."""

    class SkipInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__module__", None) == "torch.nn.init":
                return kwargs.get("tensor", args[0] if args else None)
            return func(*args, **kwargs)

    def flow(defer):
        torch.manual_seed(0)
        with SkipInit():
            if defer:
                with deferred():
                    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
            else:
                model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))
        for layer in model:  # the initialization the program really wants
            nn.init.normal_(layer.weight, std=0.1)
            nn.init.zeros_(layer.bias)
        if defer:
            materialize_module(model)
        return model, torch.rand(4)

    eager, after_eager = flow(False)
    model, after = flow(True)
    assert_same_tensors(eager, model)
    assert torch.equal(after, after_eager)


def test_mode_stacks_come_back_exactly_also_on_an_error():
    functions, dispatches = _get_current_function_mode_stack(), _get_current_dispatch_mode_stack()
    outer_f, outer_d, inner_f = CountingFunctions(), LoggingOps(), CountingFunctions()
    with outer_f, outer_d:
        with pytest.raises(ZeroDivisionError):
            with deferred():
                # ours went below the user's modes
                assert _get_current_function_mode_stack()[-1] is outer_f
                assert _get_current_dispatch_mode_stack()[-1] is outer_d
                with inner_f:
                    assert _get_current_function_mode_stack()[-1] is inner_f
                    nn.Linear(2, 2)
                1 / 0
        assert _get_current_function_mode_stack() == functions + [outer_f]
        assert _get_current_dispatch_mode_stack() == dispatches + [outer_d]
    assert _get_current_function_mode_stack() == functions
    assert _get_current_dispatch_mode_stack() == dispatches
    assert "_VariableFunctionsClass.empty" in outer_f.seen and "aten.uniform_.default" in outer_d.seen


def test_a_default_device_context_stays_at_the_bottom():
    """torch.device(...) as a context must be the bottom function mode when it leaves."""
    counting = CountingFunctions()
    with torch.device("cpu"), counting, deferred():
        with torch.device("cpu"):
            model = nn.Linear(3, 2)
    assert model.weight.device.type == "cpu" and is_deferred(model)
    assert _get_current_function_mode_stack() == []


def test_nn_parameter_of_a_fake_shows_modes_nothing_more_than_eagerly():
    """Eagerly nn.Parameter(t) takes torch.Tensor._make_subclass, which no mode
    sees; a fake takes the custom-tensor path (detach, requires_grad_)."""
    seen = {}
    for defer in (False, True):
        f, d = CountingFunctions(), LoggingOps()
        with f, d:
            if defer:
                with deferred():
                    nn.Parameter(torch.empty(3))
            else:
                nn.Parameter(torch.empty(3))
        seen[defer] = (f.seen, d.seen)
    assert seen[True] == seen[False]


@pytest.mark.parametrize("mode", ["FakeTensorMode", "make_fx"])
def test_pytorchs_tracing_and_fake_modes_are_refused_at_entry(mode):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    functions, dispatches = _get_current_function_mode_stack(), _get_current_dispatch_mode_stack()
    with pytest.raises(UnsupportedModeError, match="cannot be entered under (FakeTensorMode|ProxyTorchDispatchMode)") as info:
        if mode == "FakeTensorMode":
            with FakeTensorMode():
                with deferred():
                    nn.Linear(2, 2)
        else:
            def f(x):
                with deferred():
                    nn.Linear(2, 2)
                return x + 1
            make_fx(f)(torch.ones(2))
    assert "Enter the deferral outside that mode" in str(info.value)
    assert _get_current_function_mode_stack() == functions
    assert _get_current_dispatch_mode_stack() == dispatches
