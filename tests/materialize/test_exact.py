"""Materialization equals eager construction, bit for bit, in any order (issue 4).

Every test builds the module eagerly and deferred with the same seed and
compares every parameter and buffer; the order of materialization (whole
module, forward, reverse, shuffled) and draws from the generator in between
must not matter.
"""

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from helpers import assert_same_tensors, check_exact, eager_and_deferred, materialize_in_order
from deferinit.materialize import materialize_module, materialize_tensor

ORDERS = ["module", "forward", "reverse", 0, 1]

MODULES = {
    "Linear": lambda: nn.Linear(8, 5),
    "Conv2d": lambda: nn.Conv2d(3, 8, 3, groups=1),
    "LSTM": lambda: nn.LSTM(6, 8, num_layers=2, bidirectional=True),
    "GRU": lambda: nn.GRU(4, 6, num_layers=2),
    "MultiheadAttention": lambda: nn.MultiheadAttention(16, 4, kdim=8, vdim=8),
    "Embedding": lambda: nn.Embedding(20, 6, padding_idx=3),
    "BatchNorm2d": lambda: nn.BatchNorm2d(7),
    "LayerNorm": lambda: nn.LayerNorm(9),
    "Bilinear": lambda: nn.Bilinear(4, 5, 6),
    "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(16, 4, 32),
    "Transformer": lambda: nn.Transformer(16, 2, 2, 2, 32),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(MODULES))
def test_torch_modules(name, order):
    check_exact(MODULES[name], order=order)


class ParentDrawsFirst(nn.Module):
    """A parent draws before its children exist, and throws a random temporary away."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(3))
        torch.randn(100)  # drawn eagerly, kept by nothing
        self.child = nn.Linear(3, 3)
        self.register_buffer("noise", torch.randn(2, 3) * self.scale)
        noisy = torch.empty(4).normal_()
        self.register_buffer("shifted", noisy + 1)


@pytest.mark.parametrize("order", ORDERS)
def test_random_temporaries_and_parent_draws(order):
    check_exact(ParentDrawsFirst, order=order)


class Rotary(nn.Module):
    """A RoPE buffer computed in the constructor (lost by meta + to_empty)."""

    def __init__(self, dim=16, base=10000.0, length=32):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        t = torch.arange(length, dtype=torch.int64).type_as(inv_freq)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self.proj = nn.Linear(dim, dim)


@pytest.mark.parametrize("order", ["module", "reverse"])
def test_rope_buffers(order):
    check_exact(Rotary, order=order)


def test_half_after_deferral():
    torch.manual_seed(0)
    eager = nn.Transformer(16, 2, 1, 1, 32).half()
    torch.manual_seed(0)
    m = deferred_init(nn.Transformer, 16, 2, 1, 1, 32).half()
    materialize_in_order(m, 3)
    assert_same_tensors(eager, m)


def test_ties():
    def tied():
        emb = nn.Embedding(10, 4)
        head = nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        return nn.Sequential(emb, head)

    for order in ORDERS:
        _, m = check_exact(tied, order=order)
        assert m[0].weight is m[1].weight


def test_generator_state_after_complete_materialization_is_eagers():
    torch.manual_seed(1)
    nn.Transformer(16, 2, 1, 1, 32)
    eager_next = torch.randn(5)

    torch.manual_seed(1)
    m = deferred_init(nn.Transformer, 16, 2, 1, 1, 32)
    materialize_tensor(m.encoder.layers[0].linear1.weight)  # early draws only: left alone
    assert torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(1).get_state())  # no reseed: one would count
    materialize_module(m)  # complete, and nothing drew since deferral
    assert torch.equal(torch.randn(5), eager_next)

    torch.manual_seed(1)
    m = deferred_init(nn.Transformer, 16, 2, 1, 1, 32)
    materialize_in_order(m, "reverse")  # tensor by tensor, ends complete too
    assert torch.equal(torch.randn(5), eager_next)


def test_generator_is_left_alone_if_the_program_drew_since_deferral():
    torch.manual_seed(1)
    m = deferred_init(nn.Linear, 4, 4)
    torch.rand(1)
    state = torch.get_rng_state()
    materialize_module(m)
    assert torch.equal(torch.get_rng_state(), state)


def test_explicit_generator_advances_like_eager():
    def ctor(g):
        return nn.Parameter(torch.randn(8, generator=g))

    g = torch.Generator().manual_seed(4)
    eager = ctor(g)
    eager_next = torch.randn(3, generator=g)
    g.manual_seed(4)
    p = deferred_init(ctor, g)
    m = nn.Module()
    m.p = p
    materialize_module(m)
    assert torch.equal(m.p, eager)
    assert torch.equal(torch.randn(3, generator=g), eager_next)


def test_two_models_recorded_then_materialized_in_any_order():
    torch.manual_seed(0)
    eager_a = nn.Linear(4, 4)
    torch.manual_seed(0)
    a = deferred_init(nn.Linear, 4, 4)
    torch.manual_seed(5)
    eager_b = nn.GRU(3, 3)
    torch.manual_seed(5)
    b = deferred_init(nn.GRU, 3, 3)
    materialize_module(b)
    materialize_tensor(a.bias)
    materialize_module(a)
    assert_same_tensors(eager_a, a)
    assert_same_tensors(eager_b, b)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_recurrent_modules_recorded_for_cuda_equal_eager_on_cpu(cls):
    # On a CUDA build without a GPU, cuDNN accepts any tensor reporting cuda
    # and nn.LSTM's flatten_parameters asks the fakes for data_ptr(); fake
    # CUDA must behave as on the CPU build (fake/cudnn.py).
    enabled = torch.backends.cudnn.enabled
    torch.manual_seed(0)
    eager = cls(6, 8, num_layers=2, bidirectional=True)
    after_eager = torch.rand(4)
    torch.manual_seed(0)
    m = deferred_init(cls, 6, 8, num_layers=2, bidirectional=True, device="cuda")
    assert m.weight_ih_l0.device.type == "cuda"
    materialize_module(m, device="cpu")
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(4), after_eager)
    assert torch.backends.cudnn.enabled == enabled
