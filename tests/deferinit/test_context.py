"""``with deferred():``, the block form of ``deferred_init`` (issue 14, item 1).

Everything made in the block is recorded as inside ``deferred_init``; the
values materialized afterwards, and the generator stream after a complete
materialization, are compared with eager construction under the same seed.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.nn as nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import deferinit
from deferinit import deferred, deferred_init, is_deferred
from deferinit.random.record import current_record
from helpers import assert_same_tensors
from deferinit.materialize import materialize_module

os.environ.setdefault("HF_HUB_OFFLINE", "1")

_ORIGINAL_TRUNC_NORMAL = nn.init._no_grad_trunc_normal_


def _state():
    return (
        len(_get_current_function_mode_stack()),
        len(_get_current_dispatch_mode_stack()),
        nn.init._no_grad_trunc_normal_ is _ORIGINAL_TRUNC_NORMAL,
        current_record(),
        torch.get_default_dtype(),
    )


def _check_block(build, seed=0):
    """Build eagerly, then in a ``with deferred():`` block, same seed; materialize
    and compare values and the generator stream that follows."""
    torch.manual_seed(seed)
    eager = build()
    eager_next = torch.rand(8)
    torch.manual_seed(seed)
    before = torch.get_rng_state()
    with deferred():
        model = build()
    assert torch.equal(torch.get_rng_state(), before), "the block drew from the generator"
    assert is_deferred(model)
    materialize_module(model)
    assert torch.equal(torch.rand(8), eager_next), "generator not where eager left it"
    assert_same_tensors(eager, model)
    return eager, model


def test_exported_from_the_front_door():
    assert deferinit.deferred is deferred
    assert "deferred" in deferinit.__all__


@pytest.mark.parametrize(
    "build",
    [
        lambda: nn.Linear(16, 8),
        lambda: nn.Transformer(d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64),
        lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8, 4)),
        lambda: nn.Embedding(50, 8, padding_idx=3),
        lambda: nn.LSTM(8, 16, num_layers=2),
    ],
    ids=["linear", "transformer", "sequential", "embedding", "lstm"],
)
def test_torch_nn_modules_equal_eager(build):
    _check_block(build)


def test_everything_made_in_the_block_is_deferred_and_stays_so():
    with deferred():
        a = nn.Linear(4, 4, device="cuda")   # no CUDA needed
        t = torch.randn(3, 3)
        assert current_record() is not None
    assert current_record() is None
    assert is_deferred(a) and is_deferred(t)
    assert a.weight.device == torch.device("cuda", 0)
    # Made after the block: real again.
    assert not is_deferred(torch.randn(2))


def test_device_context_inside_the_block():
    torch.manual_seed(1)
    eager = nn.Linear(8, 8)
    torch.manual_seed(1)
    with deferred(), torch.device("cuda"):
        m = nn.Linear(8, 8)
    assert m.weight.device.type == "cuda"
    materialize_module(m, device="cpu")
    assert_same_tensors(eager, m)


class _Registry:
    made: list = []


def _factory(width, depth):
    """A factory with side effects: it draws a random temporary, reseeds in the
    middle, registers what it builds in a global list, and returns a tuple."""
    noise = torch.randn(width)            # drawn and thrown away: still advances the generator
    layers = [nn.Linear(width, width) for _ in range(depth)]
    torch.manual_seed(123)                # a reseed halfway
    head = nn.Linear(width, 2)
    _Registry.made.append(head)
    scale = nn.Parameter(noise.abs() + 1)
    return nn.Sequential(*layers, head), scale


def test_factory_function_with_side_effects_equals_eager():
    _Registry.made.clear()
    torch.manual_seed(0)
    eager, eager_scale = _factory(8, 3)
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    with deferred():
        model, scale = _factory(8, 3)
    assert _Registry.made[-1] is model[-1]
    assert is_deferred(_Registry.made[-1]) and is_deferred(scale)
    materialize_module(model)
    deferinit.materialize_tensor(scale)
    assert torch.equal(scale, eager_scale)
    assert_same_tensors(eager, model)
    assert torch.equal(torch.rand(4), eager_next)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_transformers_automodel_from_config(name):
    transformers = pytest.importorskip("transformers")
    configs = {
        "llama": lambda: transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        ),
        "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        "bert": lambda: transformers.BertConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64,
        ),
    }
    config = configs[name]()
    _, model = _check_block(lambda: transformers.AutoModelForCausalLM.from_config(config)
                            if name != "bert" else transformers.AutoModel.from_config(config))
    ids = torch.randint(0, 128, (1, 5))
    assert model(ids)[0].shape[:2] == (1, 5)


def test_nesting_with_itself_and_with_deferred_init_shares_one_record():
    torch.manual_seed(0)
    eager = [nn.Linear(4, 4) for _ in range(3)]
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    with deferred():
        record = current_record()
        a = nn.Linear(4, 4)
        with deferred():
            assert current_record() is record
            b = nn.Linear(4, 4)
        assert current_record() is record and record.open   # the inner block did not close it
        c = deferred_init(nn.Linear, 4, 4)
    assert current_record() is None and not record.open
    assert {a.weight._record, b.weight._record, c.weight._record} == {record}
    materialize_module(nn.ModuleList([c, a, b]))
    for e, m in zip(eager, (a, b, c)):
        assert_same_tensors(e, m)
    assert torch.equal(torch.rand(4), eager_next)


def test_block_inside_deferred_init():
    def build():
        first = nn.Linear(4, 4)
        with deferred():
            second = nn.Linear(4, 4)
        return nn.Sequential(first, second)

    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    eager_next = torch.rand(4)
    torch.manual_seed(0)
    m = deferred_init(build)
    assert m[0].weight._record is m[1].weight._record
    assert current_record() is None
    materialize_module(m)
    assert_same_tensors(eager, m)
    assert torch.equal(torch.rand(4), eager_next)


class _Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [_Boom, KeyboardInterrupt])
def test_exception_in_the_block_leaves_global_state_as_it_was(exc):
    before = _state()
    rng = torch.get_rng_state()
    with pytest.raises(exc) as info:
        with deferred():
            nn.Linear(4, 4)
            nn.init.trunc_normal_(torch.empty(3))
            torch.set_default_dtype(torch.float64)   # the block's own change is the user's to undo
            torch.set_default_dtype(torch.float32)
            raise exc("boom")
    assert _state() == before
    assert torch.equal(torch.get_rng_state(), rng)
    if exc is _Boom:
        notes = getattr(info.value, "__notes__", [])
        assert any("with deferred() at test_context.py:" in n for n in notes), notes


def test_exception_in_a_nested_block_gets_one_note_and_the_outer_block_keeps_recording():
    with deferred():
        with pytest.raises(_Boom) as info:
            with deferred():
                raise _Boom()
        assert not getattr(info.value, "__notes__", [])   # the outermost block adds it
        del info  # its traceback holds this frame: m would live on in a cycle and chain later records
        assert current_record() is not None
        m = nn.Linear(2, 2)
    assert is_deferred(m)
    assert current_record() is None


def test_threads_record_separately():
    """A block held open in one thread while another thread builds real models
    and runs its own block: each thread sees only its own recording."""
    inside = threading.Barrier(2, timeout=60)
    done = threading.Barrier(2, timeout=60)
    results: dict = {}
    errors = []

    def recorder():
        try:
            gen = torch.Generator().manual_seed(5)
            with deferred():
                a = nn.Parameter(torch.empty(4, 6).uniform_(generator=gen))
                inside.wait()   # the other thread works while this block is open
                done.wait()
                b = nn.Parameter(torch.empty(3).normal_(generator=gen))
            results["deferred"] = (a, b)
        except BaseException as e:  # noqa: BLE001 - reported in the main thread
            errors.append(e)

    def other():
        try:
            inside.wait()
            assert current_record() is None
            assert len(_get_current_dispatch_mode_stack()) == 0
            real = torch.empty(5).uniform_(generator=torch.Generator().manual_seed(9))
            assert not is_deferred(real)
            with deferred():
                own = torch.empty(5).uniform_(generator=torch.Generator().manual_seed(9))
            results["other"] = (real, own)
            done.wait()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=recorder), threading.Thread(target=other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    real, own = results["other"]
    assert is_deferred(own)
    deferinit.materialize_tensor(own)
    assert torch.equal(own, real)
    a, b = results["deferred"]
    gen = torch.Generator().manual_seed(5)
    eager_a = torch.empty(4, 6).uniform_(generator=gen)
    eager_b = torch.empty(3).normal_(generator=gen)
    deferinit.materialize_tensor(b)
    deferinit.materialize_tensor(a)
    assert torch.equal(a, eager_a) and torch.equal(b, eager_b)
