"""Tensors a module holds outside ``_parameters``/``_buffers`` (plain attributes,
and tensors in the lists, tuples, dicts and sets it holds) are materialized with
the module, in place, ties and views kept; compared with eager PyTorch."""

from __future__ import annotations

import collections
import math
import warnings

import pytest
import torch
import torch.nn as nn

from deferinit import ExternalTensorMutatedError, deferred_init, graph_of, is_deferred
from deferinit.fake import is_fake
from helpers import assert_same_tensors, eager_and_deferred
from deferinit.materialize import materialize_module, materialize_tensor


def attribute_tensors(module):
    """Every tensor held by attributes of the module and its submodules, in plain containers too."""
    out = {}

    def walk(name, value, seen):
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, (list, tuple, dict, set)) and id(value) not in seen:
            seen.add(id(value))
            items = value.items() if isinstance(value, dict) else enumerate(sorted(value, key=id) if isinstance(value, set) else value)
            for k, v in items:
                walk(f"{name}[{k!r}]", v, seen)

    for prefix, sub in module.named_modules():
        for key, value in vars(sub).items():
            if key not in ("_parameters", "_buffers", "_modules"):
                walk(f"{prefix}.{key}", value, set())
    return out


def assert_same_attributes(eager, m):
    a, b = attribute_tensors(eager), attribute_tensors(m)
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert not is_fake(y), f"{name} is still fake"
        assert type(x) is type(y) and x.dtype == y.dtype and x.shape == y.shape, name
        assert x.stride() == y.stride() and x.requires_grad == y.requires_grad, name
        assert torch.equal(x.detach(), y.detach()), name


# -- code as diffusers writes it ------------------------------------------------------------


class QwenEmbedRope(nn.Module):
    """diffusers' QwenImage rotary embedding: complex tables kept as plain attributes
    ("DO NOT USE REGISTER BUFFER HERE, IT WILL CAUSE COMPLEX NUMBERS LOSE ITS IMAGINARY PART")."""

    def __init__(self, theta=10000, axes_dim=(8, 4, 4), scale_rope=False):
        super().__init__()
        self.theta = theta
        self.axes_dim = list(axes_dim)
        pos_index = torch.arange(64)
        neg_index = torch.arange(64).flip(0) * -1 - 1
        self.pos_freqs = torch.cat([self.rope_params(pos_index, d, self.theta) for d in self.axes_dim], dim=1)
        self.neg_freqs = torch.cat([self.rope_params(neg_index, d, self.theta) for d in self.axes_dim], dim=1)
        self.scale_rope = scale_rope

    def rope_params(self, index, dim, theta=10000):
        freqs = torch.outer(index, 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim)))
        return torch.polar(torch.ones_like(freqs), freqs)

    def forward(self, x):
        return x * self.pos_freqs[: x.shape[0]].real


class Kandinsky5TimeEmbeddings(nn.Module):
    """diffusers' Kandinsky 5 time embedding: ``self.freqs`` is a plain attribute."""

    def __init__(self, model_dim=8, time_dim=6, max_period=10000.0):
        super().__init__()
        self.freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=model_dim // 2, dtype=torch.float32) / (model_dim // 2))
        self.in_layer = nn.Linear(model_dim, time_dim, bias=True)
        self.activation = nn.SiLU()
        self.out_layer = nn.Linear(time_dim, time_dim, bias=True)

    def forward(self, time):
        args = torch.outer(time.to(torch.float32), self.freqs.to(device=time.device))
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.out_layer(self.activation(self.in_layer(emb)))


class Rope(nn.Module):
    """The common research-code form."""

    def __init__(self, dim=8):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.freqs = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)

    def forward(self, x):
        return self.proj(x) * torch.cat([self.freqs, self.freqs])


Point = collections.namedtuple("Point", "x y")


class Containers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.noise = torch.randn(3)  # a random plain attribute: a draw of the stream
        self.table = [torch.arange(3.0), torch.ones(2)]
        self.pair = (torch.zeros(2), torch.randn(2))
        self.lookup = {"a": torch.arange(4.0) * 2, "b": torch.randn(2)}
        self.nested = {"x": [torch.ones(1)], "y": (torch.arange(2.0), {"z": torch.full((2,), 7.0)})}
        self.ordered = collections.OrderedDict(k=torch.rand(2))
        self.point = Point(torch.ones(2), torch.randn(3))
        self.after = torch.randn(2)


class Aliases(nn.Module):
    """Attributes that are buffers, parameters, or views of them."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.randn(4, 4))
        self.w = nn.Parameter(torch.randn(3))
        self.same_buf = self.buf
        self.first_row = self.buf[0]
        self.param_list = [self.w]
        self.loop = [torch.arange(2.0)]
        self.loop.append(self.loop)  # a cycle
        self.loop_dict = {}
        self.loop_dict["self"] = self.loop_dict


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.rope = Rope()
        self.blocks = nn.ModuleList([Kandinsky5TimeEmbeddings() for _ in range(2)])
        self.scale = torch.tensor(0.5)


CLASSES = [QwenEmbedRope, Kandinsky5TimeEmbeddings, Rope, Containers, Aliases, Outer]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_plain_attributes_are_materialized(cls):
    torch.manual_seed(0)
    eager = cls()
    eager_next = torch.rand(8)
    torch.manual_seed(0)
    m = deferred_init(cls)
    assert is_deferred(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize_module(m)
    assert not is_deferred(m)
    assert_same_tensors(eager, m)
    assert_same_attributes(eager, m)
    assert torch.equal(torch.rand(8), eager_next)


def test_attributes_keep_identity_ties_and_views():
    m = deferred_init(Aliases)
    objects = {name: t for name, t in attribute_tensors(m).items()}
    materialize_module(m)
    after = attribute_tensors(m)
    assert all(after[name] is t for name, t in objects.items())
    assert m.same_buf is m.buf and m.param_list[0] is m.w
    assert m.first_row.untyped_storage().data_ptr() == m.buf.untyped_storage().data_ptr()
    m.buf[0, 0] = 100.0
    assert m.first_row[0] == 100.0


@pytest.mark.parametrize("cls", [QwenEmbedRope, Kandinsky5TimeEmbeddings, Rope], ids=lambda c: c.__name__)
def test_forward_after_materialization_is_real(cls):
    eager, m = eager_and_deferred(cls)
    materialize_module(m)
    x = torch.randn(4, 8) if cls is not Kandinsky5TimeEmbeddings else torch.rand(4)
    y = m(x)
    assert not is_fake(y)
    assert torch.equal(y, eager(x))


def test_check_fn_materializes_the_chosen_submodules_attributes_only():
    eager, m = eager_and_deferred(Outer)
    materialize_module(m, check_fn=lambda sub: isinstance(sub, Rope))
    assert not is_fake(m.rope.freqs) and is_fake(m.blocks[0].freqs) and is_fake(m.scale)
    materialize_module(m)
    assert_same_attributes(eager, m)


def test_torch_modules_that_hold_tensor_attributes():
    """RNNs keep their parameters in a plain list; spectral_norm keeps a plain ``weight``."""
    def make():
        return nn.Sequential(nn.GRU(3, 4, num_layers=2), nn.utils.spectral_norm(nn.Linear(4, 4)))

    eager, m = eager_and_deferred(make)
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert_same_attributes(eager, m)
    assert all(a is b for a, b in zip(m[0]._flat_weights, m[0].parameters()))


class Holder:
    def __init__(self, t):
        self.t = t


class HoldsObject(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.holder = Holder(torch.randn(2))


def test_tensors_held_by_other_objects_are_materialized_with_the_module():
    """They are reachable from the module, so it is not done while they are
    fake (issue 25: accelerate's offload hooks keep the weights so); they
    used to be left deferred with a warning."""
    eager, m = eager_and_deferred(HoldsObject)
    assert is_deferred(m)
    materialize_tensor(m.lin.weight)
    materialize_tensor(m.lin.bias)
    assert is_deferred(m)  # m.holder.t still is
    materialize_module(m)
    assert not is_deferred(m) and not is_fake(m.holder.t)
    assert torch.equal(m.holder.t, eager.holder.t)


def test_failure_leaves_attributes_deferred_too():
    outside = torch.ones(3)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scaled = outside * 2

    m = deferred_init(M)
    scaled = m.scaled
    outside.add_(1)
    with pytest.raises(ExternalTensorMutatedError):
        materialize_module(m)
    assert m.scaled is scaled and is_fake(m.scaled) and is_deferred(m.lin.weight)


def test_graph_of_a_module_names_its_attributes():
    text = str(graph_of(deferred_init(Rope)))
    assert "# freqs" in text
