"""Reseeds between deferral and materialization are honoured (issue 26, item 4).

Eagerly a seed or a state set after construction wipes out where the
constructor left the generator, even a seed equal to the one it started
from; a state read after construction and set back (``fork_rng``'s exit)
puts back the state after construction.  Materialization moves the
generator past the deferred draws only when eager construction's state is
still the one in force: the generator afterwards draws what eager's does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from deferinit import deferred, deferred_init
from deferinit.materialize import materialize_module, materialize_tensor
from deferinit.random.rng import seeded_state
from helpers import assert_same_tensors


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.b = nn.Linear(4, 2)


def _fork():
    with torch.random.fork_rng():
        pass


def _fork_with_a_draw():
    with torch.random.fork_rng():
        torch.rand(2)


def _read_reseed_set_back():
    state = torch.get_rng_state()
    torch.manual_seed(5)
    torch.set_rng_state(state)


def _state_read_before():
    return torch.get_rng_state()


BETWEEN = {
    "nothing": lambda saved: None,
    "manual_seed(0), the seed before": lambda saved: torch.manual_seed(0),
    "manual_seed(1)": lambda saved: torch.manual_seed(1),
    "torch.random.manual_seed(0)": lambda saved: torch.random.manual_seed(0),
    "set_rng_state(the state it holds)": lambda saved: torch.set_rng_state(torch.Generator().manual_seed(0).get_state()),
    "set_rng_state(state read before)": lambda saved: torch.set_rng_state(saved),
    "fork_rng()": lambda saved: _fork(),
    "fork_rng() with a draw inside": lambda saved: _fork_with_a_draw(),
    "get_rng_state, manual_seed, set back": lambda saved: _read_reseed_set_back(),
    "torch.cuda.manual_seed_all(0)": lambda saved: torch.cuda.manual_seed_all(0),
    "torch.cuda.manual_seed(0)": lambda saved: torch.cuda.manual_seed(0),
}


def _eager(between):
    torch.manual_seed(0)
    saved = _state_read_before()
    model = Net()
    between(saved)
    return model, torch.rand(8)


def _deferred(between, materialize):
    torch.manual_seed(0)
    saved = _state_read_before()
    model = deferred_init(Net)
    between(saved)
    materialize(model)
    return model, torch.rand(8)


MATERIALIZE = {
    "module": materialize_module,
    "tensor by tensor": lambda m: [materialize_tensor(t) for t in (m.a.weight, m.a.bias, m.b.weight, m.b.bias)],
    "module, device=cpu": lambda m: materialize_module(m, device="cpu"),
}


@pytest.mark.filterwarnings("ignore::deferinit.PendingDrawsWarning")
@pytest.mark.parametrize("how", list(MATERIALIZE))
@pytest.mark.parametrize("between", list(BETWEEN))
def test_the_generator_after_materialization_is_eagers(between, how):
    eager, eager_next = _eager(BETWEEN[between])
    got, got_next = _deferred(BETWEEN[between], MATERIALIZE[how])
    assert_same_tensors(eager, got)
    assert torch.equal(eager_next, got_next), f"after {between}, the generator differs from eager's"


def test_the_report():
    """``manual_seed(0); m = deferred_init(M); manual_seed(0); materialize_module(m);
    torch.rand(3)`` equals ``manual_seed(0); M(); manual_seed(0); torch.rand(3)``."""
    torch.manual_seed(0)
    nn.Linear(3, 3)
    torch.manual_seed(0)
    eager = torch.rand(3)
    torch.manual_seed(0)
    m = deferred_init(nn.Linear, 3, 3)
    torch.manual_seed(0)
    materialize_module(m)
    assert torch.equal(torch.rand(3), eager)


def test_seed_between_leaves_the_generator_seeded_by_it():
    torch.manual_seed(0)
    m = deferred_init(Net)
    seed = torch.seed()
    materialize_module(m)
    assert torch.equal(torch.get_rng_state(), seeded_state("cpu", seed))


def test_a_seed_inside_a_later_deferral_wipes_out_an_earlier_ones_draws():
    """Eagerly the second constructor's manual_seed(0) resets the generator the
    first one advanced; the second deferral's close puts that seed in force."""

    class Seeds(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.w = nn.Parameter(torch.randn(3))

    torch.manual_seed(0)
    e1, e2 = Net(), Seeds()
    eager_next = torch.rand(8)
    torch.manual_seed(0)
    d1 = deferred_init(Net)
    d2 = deferred_init(Seeds)
    materialize_module(d1)
    materialize_module(d2)
    assert_same_tensors(e1, d1)
    assert_same_tensors(e2, d2)
    assert torch.equal(torch.rand(8), eager_next)


@pytest.mark.parametrize("order", ["first, second", "second, first"])
def test_fork_rng_between_two_deferrals_keeps_their_one_stream(order):
    """fork_rng between two deferrals puts back the state after the first: the
    second continues the first's stream, as eagerly."""
    torch.manual_seed(0)
    e1 = Net()
    _fork()
    e2 = Net()
    eager_next = torch.rand(8)
    torch.manual_seed(0)
    d1 = deferred_init(Net)
    _fork()
    d2 = deferred_init(Net)
    for m in ((d1, d2) if order == "first, second" else (d2, d1)):
        materialize_module(m)
    assert_same_tensors(e1, d1)
    assert_same_tensors(e2, d2)
    assert torch.equal(torch.rand(8), eager_next)


@pytest.mark.parametrize("between", ["torch.cuda.manual_seed_all(0)", "torch.manual_seed(0)", "fork_rng()"])
def test_fake_cuda_deferral_materialized_on_cpu(between):
    """Recorded for fake CUDA on a CPU build, materialized on CPU: eager is
    construction on CPU, whose generator a CUDA reseed does not touch."""
    act = {"torch.cuda.manual_seed_all(0)": lambda: torch.cuda.manual_seed_all(0),
           "torch.manual_seed(0)": lambda: torch.manual_seed(0), "fork_rng()": _fork}[between]
    torch.manual_seed(0)
    eager = nn.Linear(4, 3)
    act()
    eager_next = torch.rand(8)
    torch.manual_seed(0)
    d = deferred_init(nn.Linear, 4, 3, device="cuda")
    act()
    materialize_module(d, device="cpu")
    assert torch.equal(d.weight, eager.weight) and torch.equal(d.bias, eager.bias)
    assert torch.equal(torch.rand(8), eager_next)


def test_the_generator_api_is_given_back_once_nothing_is_pending():
    """The diversion that notices reseeds lasts while the record's draws may still
    be handed over or continued: until a reseed, or the record's death."""
    from deferinit.random.seeding import FUNCTIONS

    users = FUNCTIONS[0].users
    m = deferred_init(Net)
    assert FUNCTIONS[0].users == users + 1
    materialize_tensor(m.a.weight)
    assert FUNCTIONS[0].users == users + 1  # the record lives: a seed giving its bytes must still be seen
    torch.manual_seed(3)
    assert FUNCTIONS[0].users == users  # reseeded: moot, though the record lives
    materialize_module(m)
    m = deferred_init(Net)
    assert FUNCTIONS[0].users == users + 1
    materialize_module(m)
    assert FUNCTIONS[0].users == users  # all materialized: the record died


# -- transformers' set_seed and a Trainer ------------------------------------------------


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2)
    return BertForSequenceClassification(config)


def test_transformers_set_seed_between():
    transformers = pytest.importorskip("transformers")
    transformers.set_seed(42)
    eager = _tiny_bert()
    transformers.set_seed(42)
    eager_next = torch.rand(8)
    transformers.set_seed(42)
    with deferred():
        got = _tiny_bert()
    transformers.set_seed(42)
    materialize_module(got)
    assert_same_tensors(eager, got)
    assert torch.equal(torch.rand(8), eager_next)


def _train(defer: bool, out: str):
    """A Trainer-style script: seed, build, Trainer (whose __init__ seeds again),
    then train; deferred, the model is materialized after the Trainer is made."""
    from transformers import Trainer, TrainingArguments, set_seed

    set_seed(42)
    if defer:
        with deferred():
            model = _tiny_bert()
    else:
        model = _tiny_bert()
    data = [{"input_ids": torch.arange(i, i + 8) % 64, "labels": torch.tensor(i % 2)} for i in range(8)]
    args = TrainingArguments(output_dir=out, seed=42, max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, logging_steps=1, save_strategy="no", dataloader_num_workers=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)  # calls set_seed(args.seed)
    if defer:
        materialize_module(model)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, losses


def test_a_trainer_style_script_trains_as_eagerly(tmp_path):
    """The first dropout masks and the sampler's order come from the generator
    after set_seed: the losses and trained weights are eager's."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    eager, eager_losses = _train(False, str(tmp_path / "eager"))
    got, got_losses = _train(True, str(tmp_path / "deferred"))
    assert got_losses == eager_losses
    assert_same_tensors(eager, got)
