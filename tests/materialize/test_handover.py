"""Where materialization leaves the generators (issue 11, items 8 and 17), and
models deferred one after another continuing one random stream, as eager
construction does."""


import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from helpers import assert_same_tensors, assert_stream, build_and_compare
from deferinit.materialize import materialize_module, materialize_tensor

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
    torch.manual_seed(0)


DRAWING_MODULES = {
    "Linear": lambda: nn.Linear(4, 3),
    "Conv2d": lambda: nn.Conv2d(3, 4, 3),
    "Embedding": lambda: nn.Embedding(10, 4),
    "LSTM": lambda: nn.LSTM(4, 5, num_layers=2),
    "GRU": lambda: nn.GRU(4, 5),
    "Bilinear": lambda: nn.Bilinear(3, 4, 5),
    "MultiheadAttention": lambda: nn.MultiheadAttention(8, 2),
    "TransformerEncoderLayer": lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16),
    "Sequential(Linear, BN, Linear)": lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)),
}


@pytest.mark.parametrize("name", list(DRAWING_MODULES))
@pytest.mark.parametrize("device", ["cpu", CPU])
def test_generator_handover_with_device(name, device):
    """Items 8 and 17: materialize_module(m, device='cpu') on a CPU record."""
    build_and_compare(DRAWING_MODULES[name], mat={"device": device})


@pytest.mark.parametrize("name", ["Linear", "TransformerEncoderLayer", "Sequential(Linear, BN, Linear)"])
def test_generator_handover_check_fn_all(name):
    """Item 8: check_fn materialization (accepting every submodule)."""
    build_and_compare(DRAWING_MODULES[name], mat={"check_fn": lambda m: True})


def test_generator_handover_check_fn_piecewise():
    """Item 8: check_fn materializing submodules one at a time, then the stream."""
    make = lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5), nn.Linear(5, 2))  # noqa: E731
    torch.manual_seed(0)
    eager = make()
    eager_after = torch.rand(8)
    torch.manual_seed(0)
    d = deferred_init(make)
    for target in (d[2], d[0], d[1]):
        materialize_module(d, check_fn=lambda m, target=target: m is target)
    d_after = torch.rand(8)
    assert_same_tensors(eager, d)
    assert_stream(eager_after, d_after)


def test_generator_handover_buffers_only_then_params():
    make = lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))  # noqa: E731
    torch.manual_seed(0)
    eager = make()
    eager_after = torch.rand(8)
    torch.manual_seed(0)
    d = deferred_init(make)
    materialize_module(d, buffers_only=True)
    materialize_module(d)
    d_after = torch.rand(8)
    assert_same_tensors(eager, d)
    assert_stream(eager_after, d_after)


class TempLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.v = nn.Parameter(torch.randn(3))
        _ = torch.randn(5)  # a random temporary, drawn last, kept by nothing


def test_generator_handover_per_tensor_with_temporary_last():
    """Item 8: per-tensor materialization when a random temporary was drawn last."""
    torch.manual_seed(0)
    eager = TempLast()
    eager_after = torch.rand(8)
    torch.manual_seed(0)
    d = deferred_init(TempLast)
    materialize_tensor(d.v)
    materialize_tensor(d.w)
    d_after = torch.rand(8)
    assert_same_tensors(eager, d)
    assert_stream(eager_after, d_after)


@pytest.mark.parametrize("how", ["check_fn", "check_fn + device", "materialize_module(device=cpu)"])
def test_generator_handover_temporary_last_module_level(how):
    """Item 8: a random temporary drawn last, module-level materialization."""
    mat = {"check_fn": {"check_fn": lambda m: True}, "check_fn + device": {"check_fn": lambda m: True, "device": "cpu"},
           "materialize_module(device=cpu)": {"device": "cpu"}}[how]
    build_and_compare(TempLast, mat=mat)


def test_generator_handover_per_tensor_all_params():
    """Item 8 control: per-tensor materialization of every tensor, last draw kept."""
    torch.manual_seed(0)
    eager = nn.Linear(4, 3)
    eager_after = torch.rand(8)
    torch.manual_seed(0)
    d = deferred_init(nn.Linear, 4, 3)
    materialize_tensor(d.bias)
    materialize_tensor(d.weight)
    d_after = torch.rand(8)
    assert_same_tensors(eager, d)
    assert_stream(eager_after, d_after)


@pytest.mark.parametrize("mat", [{"device": "cpu"}, {"check_fn": lambda m: True}], ids=["device=cpu", "check_fn"])
def test_model_deferred_after_handover_is_exact(mat):
    """Item 8: a model deferred after such a materialization gets eager's values."""
    torch.manual_seed(0)
    e1 = nn.Linear(4, 3)
    e2 = nn.Linear(3, 2)
    torch.manual_seed(0)
    d1 = deferred_init(nn.Linear, 4, 3)
    materialize_module(d1, **mat)
    d2 = deferred_init(nn.Linear, 3, 2)
    materialize_module(d2)
    assert_same_tensors(e1, d1)
    assert_same_tensors(e2, d2)




@pytest.mark.parametrize("order", ["first then second", "second then first", "second only"])
def test_two_models_back_to_back(order):
    torch.manual_seed(0)
    e1 = nn.Linear(4, 3)
    e2 = nn.Linear(3, 2)
    eager_after = torch.rand(8)
    torch.manual_seed(0)
    d1 = deferred_init(nn.Linear, 4, 3)
    d2 = deferred_init(nn.Linear, 3, 2)
    if order == "first then second":
        materialize_module(d1)
        materialize_module(d2)
    elif order == "second then first":
        materialize_module(d2)
        materialize_module(d1)
    else:
        materialize_module(d2)
    assert_same_tensors(e2, d2)
    if order != "second only":
        assert_same_tensors(e1, d1)
        assert_stream(eager_after, torch.rand(8))


def test_two_models_back_to_back_with_temporaries_and_reseed():
    class A(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))
            _ = torch.rand(7)

    torch.manual_seed(0)
    e1, e2, e3 = A(), nn.Linear(3, 3), A()
    eager_after = torch.rand(8)
    torch.manual_seed(0)
    d1 = deferred_init(A)
    d2 = deferred_init(nn.Linear, 3, 3)
    d3 = deferred_init(A)
    materialize_module(d3)
    materialize_module(d1)
    materialize_module(d2)
    for e, d in ((e1, d1), (e2, d2), (e3, d3)):
        assert_same_tensors(e, d)
    assert_stream(eager_after, torch.rand(8))


def test_two_models_back_to_back_cuda_on_cpu():
    torch.manual_seed(0)
    e1 = nn.Linear(4, 3)
    e2 = nn.Linear(3, 2)
    torch.manual_seed(0)
    d1 = deferred_init(nn.Linear, 4, 3, device="cuda")
    d2 = deferred_init(nn.Linear, 3, 2, device="cuda")
    materialize_module(d1, device="cpu")
    materialize_module(d2, device="cpu")
    assert_same_tensors(e1, d1)
    assert_same_tensors(e2, d2)


class OnlyTemporariesDraw(nn.Module):
    """Its tensors draw nothing; random temporaries of the constructor do
    (a dropout mask computed once, a random probe thrown away)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(6.0))
        self.w = nn.Parameter(torch.ones(2, 3))
        probe = torch.empty(5).uniform_()
        _ = torch.randn(3, 2) * probe.sum()


@pytest.mark.parametrize("how", ["module", "module(device=cpu)", "tensor by tensor", "buffers_only then rest"])
def test_handover_when_only_dead_temporaries_draw(how):
    """A record whose draws are all temporaries: the materialization of its
    tensors (which need none of the draws) still leaves the generator where
    eager construction left it."""
    torch.manual_seed(0)
    eager = OnlyTemporariesDraw()
    eager_after = torch.rand(8)
    torch.manual_seed(0)
    d = deferred_init(OnlyTemporariesDraw)
    if how == "module":
        materialize_module(d)
    elif how == "module(device=cpu)":
        materialize_module(d, device="cpu")
    elif how == "tensor by tensor":
        materialize_tensor(d.b)
        materialize_tensor(d.w)
    else:
        materialize_module(d, buffers_only=True)
        materialize_module(d)
    d_after = torch.rand(8)
    assert_same_tensors(eager, d)
    assert_stream(eager_after, d_after)


def test_handover_waits_while_a_drawn_tensor_stays_deferred():
    """The control: a tensor that drew is still deferred, so the generator
    waits for it (moving it now would lose the draws' order)."""
    torch.manual_seed(0)
    eager = nn.Linear(4, 3)
    eager_after = torch.rand(8)
    torch.manual_seed(0)
    d = deferred_init(nn.Linear, 4, 3)
    materialize_tensor(d.weight)  # the bias, drawn after, is still deferred
    # (compared without reseeding: a reseed here would, as eagerly, wipe out the draws)
    assert torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(0).get_state()), (
        "the generator moved while a later draw is deferred"
    )
    materialize_tensor(d.bias)
    assert_same_tensors(eager, d)
    assert_stream(eager_after, torch.rand(8))


def _tensor_and_empty_piece():
    t = torch.randn(5, 3)
    return t, t.new_zeros(0, 3)  # as DTensor makes a rank's empty piece


def test_handover_after_a_draw_read_for_its_geometry_only():
    """A tensor that depends on a draw only for its geometry: the draw is not
    needed for values, but eager made it, and the drawn tensor staying deferred
    must not make the generator wait (ranks of a sharded model would disagree)."""
    torch.manual_seed(0)
    eager_t, eager_piece = _tensor_and_empty_piece()
    eager_after = torch.rand(8)
    torch.manual_seed(0)
    t, piece = deferred_init(_tensor_and_empty_piece)
    materialize_tensor(piece)
    state = torch.get_rng_state()
    assert_stream(eager_after, torch.rand(8))
    torch.set_rng_state(state)
    materialize_tensor(t)  # the generator was handed over already: it stays
    assert torch.equal(t, eager_t) and torch.equal(piece, eager_piece)
    assert_stream(eager_after, torch.rand(8))


class RandomFactoryParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(4))


def test_handover_waits_for_a_random_factory_a_load_overwrites():
    """As for nn.init fills a checkpoint overwrites: a parameter made by a random
    factory and loaded is allocated, not drawn, and the generator stays where
    deferral left it."""
    from deferinit.materialize import load_checkpoint

    torch.manual_seed(0)
    untouched = torch.rand(8)
    torch.manual_seed(0)
    d = deferred_init(RandomFactoryParameter)
    load_checkpoint(d, {"p": torch.ones(4)})
    materialize_module(d)
    assert torch.equal(d.p, torch.ones(4))
    assert_stream(untouched, torch.rand(8))


class TwoDevices(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.a = nn.Parameter(torch.randn(4, device=second))
        self.b = nn.Parameter(torch.randn(4, device=first))
        self.c = nn.Parameter(torch.randn(4, device=second))


@pytest.mark.parametrize("order", [["b"], ["c"], ["c", "b", "a"], ["a", "b", "c"], ["b", "c", "a"]], ids="-".join)
def test_a_record_of_two_devices_materialized_on_one_in_any_order(order):
    """With device=, every draw comes from the target device's generator in
    recorded order, also when a tensor of one recorded device is materialized
    before (or without) those of the other."""
    torch.manual_seed(0)
    eager = TwoDevices("cpu", "cpu")
    eager_after = torch.rand(8)
    torch.manual_seed(0)
    d = deferred_init(TwoDevices, "cpu", "cuda")
    for name in order:
        materialize_tensor(getattr(d, name), device="cpu")
        assert torch.equal(getattr(d, name), getattr(eager, name)), f"{name} differs from eager on cpu"
    if len(order) == 3:
        assert_stream(eager_after, torch.rand(8))
