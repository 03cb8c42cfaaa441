"""PyTorch's own ``model.load_state_dict(sd)`` on a deferred model (issue 18, item 3):
its copies from real tensors hide the initialization they overwrite, as
``load_checkpoint``'s loads do: no random kernel runs for a full state dict,
the values are eager's (construction then ``load_state_dict``), and the
generator follows load_checkpoint's contract (eager's when the replay reaches
the end of the stream, else where deferral left it).  Any ``copy_`` from a
real tensor after deferral counts, not the method's name; a copy made while
constructing is construction, and the generator stays eager's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from helpers import assert_same_tensors, check_jump_models
from deferinit.materialize import load_checkpoint, materialize_module

RANDOM_KERNELS = ("uniform_", "normal_", "random_", "bernoulli", "exponential_", "randn", "rand")


class MLP(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(2 * d)
        self.down = nn.Linear(2 * d, d)


class Tied(nn.Module):
    def __init__(self, vocab=11, d=4):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.empty(3, d))
        nn.init.trunc_normal_(self.pos, std=0.2)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight


def conv_bn():
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3))


MODELS = {"mlp": MLP, "tied": Tied, "convbn": conv_bn}


def checkpoint_of(build, seed=123) -> dict:
    """Another seed's values, buffers changed too (a tied tensor under each name)."""
    torch.manual_seed(seed)
    m = build()
    with torch.no_grad():
        for t in m.buffers():
            t.add_(3)
    return {k: v.clone() for k, v in m.state_dict().items()}


def reference(build, sd, seed=0):
    torch.manual_seed(seed)
    m = build()
    m.load_state_dict(sd, strict=False)
    return m, torch.rand(8)


def untouched_next(seed=0):
    torch.manual_seed(seed)
    return torch.rand(8)


def random_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    check_jump_models()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if any(k in e.name for k in RANDOM_KERNELS)]


@pytest.mark.parametrize("model", list(MODELS))
def test_full_state_dict_runs_no_random_kernel(model):
    build = MODELS[model]
    sd = checkpoint_of(build)
    eager, _ = reference(build, sd)
    torch.manual_seed(0)
    m = deferred_init(build)
    assert tuple(m.load_state_dict(sd, strict=False)) == tuple(eager.load_state_dict(sd, strict=False))
    ran = random_kernels(lambda: materialize_module(m))
    assert ran == []
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(8), untouched_next())  # as after load_checkpoint


@pytest.mark.parametrize("keep", [("up.",), ("up.", "norm."), ("down.",), ("norm.",)])
def test_partial_state_dict_equals_load_checkpoint(keep):
    sd = {k: v for k, v in checkpoint_of(MLP).items() if k.startswith(keep)}
    eager, eager_next = reference(MLP, sd)
    torch.manual_seed(0)
    m = deferred_init(MLP)
    m.load_state_dict(sd, strict=False)
    ran = random_kernels(lambda: materialize_module(m))
    assert_same_tensors(eager, m)
    torch.manual_seed(0)
    c = deferred_init(MLP)
    load_checkpoint(c, sd, strict=False)
    assert len(ran) == len(random_kernels(lambda: materialize_module(c)))
    down_loaded = "down." in keep
    assert len(ran) == 2 * sum(layer not in keep for layer in ("up.", "down."))  # the live draws only
    assert torch.equal(torch.rand(8), untouched_next() if down_loaded else eager_next)


def test_any_copy_from_a_real_tensor_after_deferral_hides_what_it_overwrites():
    torch.manual_seed(0)
    eager = nn.Linear(3, 4)
    with torch.no_grad():
        eager.weight.copy_(torch.ones(4, 3))
        eager.bias.copy_(torch.zeros(4))
    torch.manual_seed(0)
    m = deferred_init(nn.Linear, 3, 4)
    with torch.no_grad():
        m.weight.copy_(torch.ones(4, 3))
        m.bias.copy_(torch.zeros(4))
    assert random_kernels(lambda: materialize_module(m)) == []
    assert_same_tensors(eager, m)


def test_a_copy_while_constructing_is_construction():
    """The generator after construction stays eager's: the copy is not a load."""

    def build():
        lin = nn.Linear(3, 4)
        with torch.no_grad():
            lin.weight.copy_(torch.ones(4, 3))
        return lin

    torch.manual_seed(0)
    eager = build()
    eager_next = torch.rand(8)
    torch.manual_seed(0)
    m = deferred_init(build)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(8), eager_next)


def test_assign_true_keeps_working():
    sd = checkpoint_of(MLP)
    torch.manual_seed(0)
    eager = MLP()
    eager.load_state_dict(sd, assign=True)
    torch.manual_seed(0)
    m = deferred_init(MLP)
    m.load_state_dict(sd, assign=True)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert m.up.weight is not sd["up.weight"] and torch.equal(m.up.weight, sd["up.weight"])
    # Every draw went into a tensor the state dict replaced: none is replayed,
    # the generator stays where deferral left it (as after a full load).
    assert torch.equal(torch.rand(8), untouched_next())


def test_a_state_dict_tensor_given_other_memory_afterwards_changes_nothing():
    """``sd[k].data = other`` after ``model.load_state_dict(sd)``: eager copied the
    old values at the call; the recorded copy reads the memory it was given."""
    sd = checkpoint_of(MLP)
    eager, _ = reference(MLP, sd)
    torch.manual_seed(0)
    m = deferred_init(MLP)
    m.load_state_dict(sd)
    for t in sd.values():
        t.data = torch.zeros_like(t)
    materialize_module(m)
    assert_same_tensors(eager, m)


def test_an_outside_tensor_given_other_memory_after_deferral_changes_nothing():
    class Scaled(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = nn.Parameter(w * 2)

    w = torch.arange(4.0)
    eager = Scaled(w)
    m = deferred_init(Scaled, w)
    w.data = torch.zeros(4)
    materialize_module(m)
    assert_same_tensors(eager, m)


def test_a_state_dict_of_inference_tensors_is_read_at_the_call_as_eagerly():
    """Eager copies them; they have no version counter to check later, so the
    recorded copy reads them at the call (a later change in inference mode
    changes nothing)."""
    with torch.inference_mode():
        sd = {k: v.clone() for k, v in checkpoint_of(MLP).items()}
    eager, _ = reference(MLP, sd)
    torch.manual_seed(0)
    m = deferred_init(MLP)
    m.load_state_dict(sd)
    with torch.inference_mode():
        for t in sd.values():
            t.add_(1)
    materialize_module(m)
    assert_same_tensors(eager, m)


def test_a_state_dict_of_wrapper_subclass_tensors_loads_as_eagerly():
    """A wrapper subclass's memory is empty: replay read it and the process died
    (SIGSEGV). copy_ reads it through its dispatch at the call, as eagerly."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, torch.nn as nn\n"
        "from torch.testing._internal.two_tensor import TwoTensor\n"
        "from deferinit import deferred_init\n"
        "from materialize import materialize_module\n"
        "sd = {'weight': TwoTensor(torch.ones(3, 3), torch.full((3, 3), 2.0)), 'bias': torch.ones(3)}\n"
        "eager = nn.Linear(3, 3)\n"
        "eager.load_state_dict(sd)\n"
        "m = deferred_init(nn.Linear, 3, 3)\n"
        "m.load_state_dict(sd)\n"
        "materialize_module(m)\n"
        "assert type(m.weight) is nn.Parameter and torch.equal(m.weight.detach(), eager.weight.detach())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:] or f"killed by signal {-proc.returncode}"
