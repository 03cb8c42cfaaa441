"""deferred_init: what the record captures (issue 3).

Recording is checked two ways: by reading the graph (ops, aliasing, writes)
and by materializing and comparing with eager PyTorch, the reference.
"""

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from deferinit import DataDependentError, InferenceTensorInputError, MixedFakeError, deferred_init, graph_of, is_deferred
from deferinit.ir.graph import Input, Node, Storage, Value
from deferinit.fake import fake_mode, is_fake
from helpers import assert_same_tensors, check_exact
from deferinit.materialize import materialize_module, materialize_tensor

CUDA = torch.device("cuda", 0)


def ops(obj):
    """The recorded op names of a module or tensor, in order."""
    return [str(n.target) if n.kind == "op" else n.kind for n in graph_of(obj).nodes]


# -- the API ---------------------------------------------------------------------------


def test_returns_what_the_callable_returns_with_every_tensor_fake():
    result = deferred_init(lambda: (torch.nn.Linear(2, 3), torch.ones(2), 7))
    linear, ones, seven = result
    assert seven == 7
    assert is_fake(linear.weight) and is_fake(ones)
    assert is_deferred(linear) and is_deferred(ones) and is_deferred(linear.bias)


@pytest.mark.parametrize("device", ["cuda", "cpu", torch.device("cuda", 0)])
def test_explicit_device_also_cuda_without_cuda(device):
    m = deferred_init(torch.nn.Linear, 4, 4, device=device)
    assert m.weight.device == torch.device(device if device != "cuda" else CUDA)


def test_default_device_contexts():
    with torch.device("cuda"):
        a = deferred_init(torch.nn.Linear, 2, 2)
    assert a.weight.device == CUDA
    torch.set_default_device("cuda")
    try:
        b = deferred_init(torch.nn.Linear, 2, 2)
    finally:
        torch.set_default_device(None)
    assert b.weight.device == CUDA
    c = deferred_init(torch.nn.Linear, 2, 2)
    assert c.weight.device.type == "cpu"


def test_nested_calls_share_one_record():
    def outer(defer):
        inner = defer(torch.nn.Linear, 2, 2)
        return torch.nn.Sequential(inner, torch.nn.Linear(2, 2))

    m = deferred_init(outer, deferred_init)
    assert m[0].weight._record is m[1].weight._record
    torch.manual_seed(0)
    eager = outer(lambda ctor, *args: ctor(*args))
    torch.manual_seed(0)
    m = deferred_init(outer, deferred_init)
    materialize_module(m)
    assert_same_tensors(eager, m)


def test_is_deferred():
    m = deferred_init(torch.nn.Linear, 2, 2)
    assert is_deferred(m) and is_deferred(m.weight)
    assert not is_deferred(torch.nn.Linear(2, 2))
    assert not is_deferred(torch.ones(2))
    with fake_mode():
        plain = torch.ones(2)
    assert is_fake(plain) and not is_deferred(plain)  # no record: cannot be materialized
    materialize_tensor(m.weight)
    assert not is_deferred(m.weight) and is_deferred(m)
    materialize_module(m)
    assert not is_deferred(m)
    for bad in (3, "x", [torch.ones(1)], None):
        with pytest.raises(ValueError, match="tensor or an nn.Module"):
            is_deferred(bad)


def test_recording_is_thread_local():
    results = {}
    started = threading.Event()
    release = threading.Event()

    def ctor():
        started.set()
        release.wait(5)
        return torch.nn.Linear(2, 2)

    def record():
        results["deferred"] = deferred_init(ctor)

    thread = threading.Thread(target=record)
    thread.start()
    started.wait(5)
    real = torch.nn.Linear(2, 2)  # this thread is not recording
    release.set()
    thread.join(5)
    assert not is_fake(real.weight)
    assert is_deferred(results["deferred"])


def test_global_state_restored_after_a_failing_constructor():
    dtype_before = torch.get_default_dtype()
    state_before = torch.get_rng_state()

    class Boom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(2, 2)
            torch.set_default_dtype(torch.float64)  # the constructor's own change
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom") as err:
        deferred_init(Boom)
    torch.set_default_dtype(dtype_before)
    assert any("Boom)" in note for note in getattr(err.value, "__notes__", []))
    assert torch.equal(torch.get_rng_state(), state_before)
    assert not is_fake(torch.ones(1))
    assert torch.nn.init._no_grad_trunc_normal_.__module__ == "torch.nn.init"


def test_recording_draws_no_random_numbers():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    g = torch.Generator().manual_seed(5)
    g_before = g.get_state()

    def ctor():
        m = torch.nn.Transformer(16, 2, 1, 1, 32)
        m.extra = torch.nn.Parameter(torch.randn(3, generator=g))
        torch.nn.init.trunc_normal_(m.extra)
        return m

    deferred_init(ctor)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(g.get_state(), g_before)
    assert torch.initial_seed() == 3


# -- what the graph holds ----------------------------------------------------------------


def test_linear_graph():
    m = deferred_init(torch.nn.Linear, 4, 2)
    # nn.Parameter(t) detaches t: the same value under another object, no node
    assert ops(m) == [
        "aten.empty.memory_format",
        "aten.empty.memory_format",
        "aten.uniform_.default",
        "aten.uniform_.default",
    ]
    text = str(graph_of(m))
    assert text.splitlines()[2] == "%2 = aten.uniform_(%0, -0.5, 0.5)  # weight"
    assert "# bias" in text.splitlines()[3]
    assert len(text.splitlines()) == 4


def test_graph_is_reachable_from_a_tensor_and_prints_one_op_per_line():
    m = deferred_init(torch.nn.Embedding, 10, 4, padding_idx=0)
    g = graph_of(m.weight)
    lines = str(g).splitlines()
    assert len(lines) == len(g.nodes) == 4
    assert lines[1] == "%1 = aten.normal_(%0, 0, 1)  # tensor"
    assert lines[2] == "%2 = aten.select.int(%1, 0, 0)"
    assert lines[3] == "%3 = aten.fill_.Scalar(%2, 0)  # tensor"
    assert graph_of(torch.ones(2)).nodes == []


def test_multi_output_ops_record_each_output():
    def ctor():
        m = torch.nn.Module()
        a, b = torch.arange(6.0).split(3)
        m.register_buffer("a", a)
        m.register_buffer("b", b * 2)
        return m

    m = deferred_init(ctor)
    split = [n for n in graph_of(m).nodes if n.kind == "op" and n.target._opname == "split"]
    assert len(split) == 1
    assert m.b._value.node is not split[0]
    assert any(type(x) is Input and x.value.node is split[0] and x.value.index == 1 for n in graph_of(m).nodes for x in n.flat)
    check_exact(ctor)


def test_views_share_storage_and_writes_are_listed_on_it():
    def ctor():
        m = torch.nn.Module()
        base = torch.zeros(2, 3)
        view = base[0]
        base.add_(1)
        m.register_buffer("base", base)
        m.register_buffer("view", view)
        m.register_buffer("before", view.clone())
        base.mul_(5)
        return m

    m = deferred_init(ctor)
    assert m.base._storage is m.view._storage
    assert m.before._storage is not m.base._storage
    head = m.base._storage.head
    assert str(head.target) == "aten.mul_.Tensor" and head.writes == (0,)
    previous = head.flat[0].version
    assert str(previous.target) == "aten.add_.Tensor"
    # the design note's example: a view taken before an in-place op on its base sees it
    check_exact(ctor)
    for order in ("reverse", 1, 2):
        check_exact(ctor, order=order)


def test_view_then_mutate_design_note_example():
    def ctor():
        m = torch.nn.Module()
        a = torch.ones([2, 2])
        b = a.view(-1)
        a.add_(2)
        m.register_buffer("b", b)
        return m

    m = deferred_init(ctor)
    materialize_tensor(m.b)
    assert torch.equal(m.b, torch.full((4,), 3.0))


def test_in_place_shape_changes_make_a_new_value():
    def ctor():
        m = torch.nn.Module()
        a = torch.arange(6.0).reshape(2, 3)
        b = a.detach()
        a.t_()
        a.unsqueeze_(0)
        m.register_buffer("a", a)
        m.register_buffer("b", b)
        return m

    m = deferred_init(ctor)
    assert m.a.shape == (1, 3, 2) and m.b.shape == (2, 3)
    assert m.a._value is not m.b._value
    check_exact(ctor)
    check_exact(ctor, order="reverse")


# -- variable-level calls -----------------------------------------------------------------


def test_data_reads_and_writes():
    def ctor():
        m = torch.nn.Linear(4, 4)
        m.weight.data = torch.randn(4, 4) * 0.1  # set_data
        m.bias.data.normal_()  # write through a .data read
        m.weight.data[0].zero_()
        m.p = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
        m.p.requires_grad = True
        m.q = torch.nn.Parameter(torch.ones(3)).requires_grad_(False)
        m.r = torch.nn.Parameter(torch.zeros(2, 2))
        m.r.data = torch.ones(5)  # a new shape through .data
        return m

    m = deferred_init(ctor)
    assert m.p.requires_grad and not m.q.requires_grad
    assert m.r.shape == (5,) and isinstance(m.r, torch.nn.Parameter)
    check_exact(ctor)
    check_exact(ctor, order=3)


class MyParameter(torch.nn.Parameter):
    pass


def test_parameter_class_and_flag_are_kept():
    def ctor():
        m = torch.nn.Module()
        m.a = MyParameter(torch.randn(2))
        m.b = torch.nn.Parameter(torch.randn(2), requires_grad=False)
        return m

    m = deferred_init(ctor)
    assert isinstance(m.a, torch.nn.Parameter) and m.a._param_cls is MyParameter
    materialize_module(m)
    assert type(m.a) is MyParameter and type(m.b) is torch.nn.Parameter
    assert m.a.requires_grad and not m.b.requires_grad
    check_exact(ctor)


# -- constants, outside tensors --------------------------------------------------------------


def test_constants_of_every_kind_are_captured_by_value():
    array = np.arange(4.0)

    def ctor():
        m = torch.nn.Module()
        m.register_buffer("tensor", torch.tensor([1.0, 2.0, 3.0]))
        m.register_buffer("as_tensor", torch.as_tensor([[1, 2]]))
        m.register_buffer("numpy", torch.from_numpy(array))
        m.register_buffer("legacy", torch.Tensor([4, 5]))
        m.register_buffer("typed", torch.FloatTensor([6, 7]))
        m.register_buffer("long", torch.LongTensor([8]))
        m.register_buffer("on_cuda", torch.tensor([1.5], device="cuda"))
        m.register_buffer("new", torch.ones(2).new_tensor([9, 10]))
        m.register_buffer("scalar", torch.scalar_tensor(2.5))
        return m

    m = deferred_init(ctor)
    assert all(is_deferred(t) for t in m.buffers())
    assert {n.kind for n in graph_of(m).nodes} >= {"constant"}
    array[:] = -1  # changing the source later does not change the constant
    assert m.on_cuda.device == CUDA
    materialize_module(m, device="cpu")
    assert m.numpy.tolist() == [0.0, 1.0, 2.0, 3.0] and m.numpy.dtype == torch.float64
    assert m.as_tensor.tolist() == [[1, 2]] and m.long.dtype == torch.int64
    assert m.legacy.tolist() == [4.0, 5.0] and m.typed.tolist() == [6.0, 7.0]
    assert m.on_cuda.tolist() == [1.5] and m.new.tolist() == [9.0, 10.0] and m.scalar.item() == 2.5
    assert m.tensor.tolist() == [1.0, 2.0, 3.0]


def test_outside_tensors_are_kept_by_reference_with_their_version():
    outside = torch.arange(3.0)

    def ctor():
        m = torch.nn.Module()
        m.register_buffer("twice", outside * 2)
        return m

    m = deferred_init(ctor)
    node = next(n for n in graph_of(m).nodes if n.kind == "external")
    assert node.payload is outside and node.version == outside._version
    materialize_module(m)
    assert torch.equal(m.twice, outside * 2)


def test_inference_tensors_are_rejected():
    with torch.inference_mode():
        frozen = torch.ones(2)
    with pytest.raises(InferenceTensorInputError, match="inference tensor"):
        deferred_init(lambda: frozen + 1)


def test_fakes_from_fake_mode_are_rejected():
    with fake_mode():
        plain = torch.ones(2)
    with pytest.raises(MixedFakeError, match="fake_mode"):
        deferred_init(lambda: plain * 2)


# -- data-dependent initialisers --------------------------------------------------------------


def test_trunc_normal_is_one_opaque_call_wherever_it_comes_from():
    from torch.nn.init import trunc_normal_ as aliased

    def ctor():
        m = torch.nn.Module()
        m.a = torch.nn.Parameter(torch.empty(64, 64))
        torch.nn.init.trunc_normal_(m.a, std=0.02)
        m.b = torch.nn.Parameter(torch.empty(16))
        aliased(m.b, mean=0.0, std=1.0, a=-0.5, b=0.5)  # rejection rate ~60%
        m.c = torch.nn.Linear(3, 3)
        return m

    m = deferred_init(ctor)
    opaque = [n for n in graph_of(m).nodes if n.kind == "opaque"]
    assert len(opaque) == 2
    assert all(n.rng is not None for n in opaque)
    for order in ("module", "reverse", 5):
        check_exact(ctor, order=order)


def test_trunc_normal_through_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=16, patch_size=8)
    m = deferred_init(ViTModel, cfg)
    assert any(n.kind == "opaque" for n in graph_of(m).nodes)
    check_exact(ViTModel, cfg)


# -- exactness state ---------------------------------------------------------------------------


def test_explicit_generators_and_reseeding_inside_the_constructor():
    def ctor():
        m = torch.nn.Module()
        g = torch.Generator().manual_seed(123)
        m.a = torch.nn.Parameter(torch.randn(4, generator=g))
        m.b = torch.nn.Parameter(torch.empty(4).uniform_(generator=g))
        m.c = torch.nn.Parameter(torch.randn(4))
        g.manual_seed(123)  # the same state it had: undetectable by comparing states
        m.d = torch.nn.Parameter(torch.randn(4, generator=g))
        torch.manual_seed(7)
        m.e = torch.nn.Linear(3, 3)
        torch.manual_seed(7)
        m.f = torch.nn.Linear(3, 3)
        with torch.random.fork_rng():
            m.g = torch.nn.Parameter(torch.randn(2))
        m.h = torch.nn.Parameter(torch.randn(2))  # same numbers as g
        return m

    for order in ("module", "reverse", 11):
        eager, _ = check_exact(ctor, order=order)
    assert torch.equal(eager.g, eager.h)


def test_default_dtype_at_record_time_is_replayed():
    def ctor():
        torch.set_default_dtype(torch.float64)
        try:
            m = torch.nn.Linear(3, 3)
            m.register_buffer("third", torch.arange(4) / 3)
            m.register_buffer("full", torch.full((2,), 0.1))
        finally:
            torch.set_default_dtype(torch.float32)
        return m

    m = deferred_init(ctor)
    assert m.weight.dtype == torch.float64 and m.third.dtype == torch.float64
    check_exact(ctor)


# -- values needed while recording ---------------------------------------------------------------


def test_item_and_tolist_while_recording():
    class Timmish(torch.nn.Module):
        def __init__(self, depth=4, rate=0.1):
            super().__init__()
            rates = [x.item() for x in torch.linspace(0, rate, depth)]
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in rates)
            self.register_buffer("rates", torch.tensor(rates))
            self.n = int(torch.arange(5).sum())
            self.listed = torch.arange(3).tolist()
            jitter = torch.rand(1).item()  # a random value: computed exactly
            self.register_buffer("jitter", torch.full((2,), jitter))
            if torch.randn(3).sum() > 0:  # control flow on random data
                self.extra = torch.nn.Linear(2, 2)

    torch.manual_seed(0)
    eager = Timmish()
    torch.manual_seed(0)
    m = deferred_init(Timmish)
    assert m.n == 10 and m.listed == [0, 1, 2]
    assert hasattr(m, "extra") == hasattr(eager, "extra")
    for seed in range(4):
        check_exact(Timmish, seed=seed)


def test_value_of_an_absent_device_is_a_clear_error():
    def ctor():
        x = torch.rand(1, device="cuda")
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        return x.item()

    with pytest.raises(DataDependentError, match=r"item\(\).*cuda:0.*does not exist"):
        deferred_init(ctor)


# -- deferred after deferred_init ---------------------------------------------------------------


def test_ops_after_deferral_extend_the_record():
    def build():
        return torch.nn.Linear(4, 4)

    def eager_then(fn):
        torch.manual_seed(0)
        return fn(build())

    for fn in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.double().float()):
        eager = eager_then(fn)
        torch.manual_seed(0)
        m = fn(deferred_init(build))
        assert is_deferred(m) and m.weight.dtype == eager.weight.dtype
        materialize_module(m)
        assert_same_tensors(eager, m)

    torch.manual_seed(0)
    m = deferred_init(build).cuda()
    assert m.weight.device == CUDA and is_deferred(m)
    materialize_module(m, device="cpu")
    torch.manual_seed(0)
    assert torch.equal(m.weight, build().weight)


# -- memory --------------------------------------------------------------------------------------


def test_graph_holds_no_fake_and_the_record_dies_with_the_last_fake():
    m = deferred_init(torch.nn.Transformer, 16, 2, 1, 1, 32)
    record = weakref.ref(m.encoder.layers[0].linear1.weight._record)
    nodes = [weakref.ref(n) for n in graph_of(m).nodes]
    assert not any(is_fake(x) for r in nodes for x in r().flat)
    assert not any(is_fake(obj) for obj in gc.get_referents(*[r() for r in nodes]))
    del m
    gc.collect()
    assert record() is None
    assert all(r() is None for r in nodes)


def test_no_reference_cycles_in_the_record():
    gc.collect()
    gc.disable()
    try:
        m = deferred_init(torch.nn.Transformer, 16, 2, 1, 1, 32)
        record = weakref.ref(m.encoder.layers[0].linear1.weight._record)
        del m
        # freed by reference counting alone, without the cycle collector
        assert record() is None
    finally:
        gc.enable()


def test_node_value_storage_types():
    m = deferred_init(torch.nn.Linear, 2, 2)
    value, storage = m.weight._value, m.weight._storage
    assert isinstance(value, Value) and isinstance(storage, Storage) and isinstance(value.node, Node)
    assert value.storage is storage
    assert (value.size, value.dtype, value.device) == ((2, 2), torch.float32, torch.device("cpu"))


# -- reading the records of common modules ------------------------------------------------


def history(graph, name):
    """Op names (aten overload packets) of the nodes that made and wrote ``name``."""
    return [n.target._opname if n.kind == "op" else n.kind for n in graph.nodes if name in graph.labels.get(id(n), [])]


def test_lstm_record():
    m = deferred_init(torch.nn.LSTM, 4, 6, num_layers=2)
    g = graph_of(m)
    for name, _ in m.named_parameters():
        assert history(g, name) == ["empty", "uniform_"], name  # empty -> Parameter -> reset_parameters
    assert sum(1 for n in g.nodes if n.rng is not None) == len(list(m.parameters()))
    check_exact(torch.nn.LSTM, 4, 6, num_layers=2)


def test_multihead_attention_record():
    m = deferred_init(torch.nn.MultiheadAttention, 16, 4)
    g = graph_of(m)
    assert history(g, "in_proj_weight") == ["empty", "uniform_"]  # xavier_uniform_
    assert history(g, "in_proj_bias") == ["empty", "fill_"]  # constant_(0)
    assert history(g, "out_proj.bias") == ["empty", "uniform_", "fill_"]  # Linear init, then constant_(0)
    check_exact(torch.nn.MultiheadAttention, 16, 4)


def test_rope_record_is_computation_not_random():
    class Rotary(torch.nn.Module):
        def __init__(self, dim=8, base=10000.0, length=16):
            super().__init__()
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            freqs = torch.outer(torch.arange(length).float(), inv_freq)
            self.register_buffer("cos", torch.cat((freqs, freqs), -1).cos())

    m = deferred_init(Rotary)
    g = graph_of(m)
    ops = [n.target._opname for n in g.nodes if n.kind == "op"]
    assert {"arange", "pow", "cat", "cos"} <= set(ops)
    assert all(n.rng is None for n in g.nodes)
    check_exact(Rotary)


def test_tied_weights_are_one_tensor_in_the_record():
    def tied():
        emb = torch.nn.Embedding(10, 4)
        head = torch.nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        return torch.nn.Sequential(emb, head)

    m = deferred_init(tied)
    assert m[0].weight is m[1].weight
    g = graph_of(m)
    normal = next(n for n in g.nodes if n.kind == "op" and n.target._opname == "normal_")
    assert g.labels[id(normal)] == ["0.weight"]
    # the head's own init drew too (eagerly it did, before the tie): the draw
    # stays in the record's random stream, though no tensor needs its result
    stream = m[0].weight._record.streams[torch.device("cpu")]
    assert [n.target._opname for n in stream.nodes] == ["normal_", "uniform_"]
    assert [n.target._opname for n in g.nodes if n.rng is not None] == ["normal_"]
    check_exact(tied)


def test_llama_record_from_a_small_config():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )
    m = deferred_init(transformers.LlamaForCausalLM, config)
    assert is_deferred(m)
    g = graph_of(m)
    # transformers re-initialises every Linear with normal_(0, initializer_range) in post_init
    assert history(g, "model.layers.0.self_attn.q_proj.weight")[-1] == "normal_"
    assert history(g, "model.norm.weight")[-1] == "fill_"
    rope = [name for name, _ in m.named_buffers()]
    assert all(is_deferred(b) for b in m.buffers()) and rope
    check_exact(transformers.LlamaForCausalLM, config)


def test_non_callable_is_a_type_error():
    with pytest.raises(TypeError, match="callable"):
        deferred_init(torch.nn.Linear(2, 2).weight)


def test_recording_time_values_have_a_size_limit(monkeypatch):
    from deferinit.materialize import evaluate

    monkeypatch.setattr(evaluate, "LIMIT_BYTES", 1024)
    with pytest.raises(DataDependentError, match="LIMIT_BYTES"):
        deferred_init(lambda: torch.randn(1000).sum().item())
    assert deferred_init(lambda: torch.ones(4).sum().item()) == 4.0
