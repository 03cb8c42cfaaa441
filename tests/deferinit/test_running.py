"""Running a deferred model before it is real (issues 13 and 14): inside
fake_mode a whole training step computes on fakes and leaves the record alone;
outside it a forward pass warns once per module and computes on fakes,
unrecorded, and writes to deferred tensors it would make are refused.
Changing a deferred model outside a forward pass is still recorded.
Afterwards materialization equals eager construction (plus the recorded
changes), bit for bit.
"""

import warnings

import pytest
import torch
import torch.nn as nn

from deferinit import DeferredModuleWarning, DeferredWriteError, MixedFakeError, RecordingError, deferred_init, graph_of
from deferinit.fake import fake_mode, is_fake
from helpers import assert_same_tensors
from deferinit.materialize import materialize_module


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, attention_dropout=0.1)
    return LlamaForCausalLM(cfg)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=100, n_positions=64))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def token_step(model):
    ids = torch.randint(0, 100, (2, 16))
    return model(ids, labels=ids).loss


def image_step(model):
    return model(torch.randn(2, 3, 12, 12)).pow(2).mean()


CORPUS = {"llama": (tiny_llama, token_step), "gpt2": (tiny_gpt2, token_step), "cnn": (CNN, image_step)}


def record_size(model) -> tuple[int, int]:
    """(nodes the parameters and buffers need, random draws of the record)."""
    record = next(t._record for t in model.parameters())
    return len(graph_of(model)), sum(len(s.nodes) for s in record.streams.values())


def eager(build):
    torch.manual_seed(0)
    return build()


def deferred(build):
    torch.manual_seed(0)
    return deferred_init(build)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_training_steps_inside_fake_mode_leave_the_record_alone(name, foreach):
    build, step = CORPUS[name]
    model = deferred(build)
    size = record_size(model)
    with fake_mode():
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
        for _ in range(2):
            step(model).backward()
            opt.step()
            opt.zero_grad()
        assert opt.state[next(model.parameters())]["step"].item() == 2.0
    assert record_size(model) == size
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeferredModuleWarning)  # none inside fake_mode
        with fake_mode():
            step(model)
    materialize_module(model)
    assert_same_tensors(eager(build), model)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_forward_outside_fake_mode_warns_once_per_module_and_records_nothing(name):
    build, step = CORPUS[name]
    model = deferred(build)
    model.eval()  # no write to running statistics
    other = deferred(build).eval()
    size = record_size(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            loss = step(model)
            loss.backward()
        step(other)
    ours = [w for w in caught if issubclass(w.category, DeferredModuleWarning)]
    assert len(ours) == 2  # once for each module, however many passes
    message = str(ours[0].message)
    assert type(model).__name__ in message and "still deferred" in message
    assert "materialize_module(model)" in message and "fake_mode" in message
    assert is_fake(loss) and loss._record is None  # a plain fake: nothing to record
    assert record_size(model) == size
    materialize_module(model)
    assert_same_tensors(eager(build), model)


def test_batchnorm_in_training_mode_refuses_to_write_running_stats_outside_fake_mode():
    model = deferred(CNN)
    model.train()
    with pytest.warns(DeferredModuleWarning), pytest.raises(DeferredWriteError) as info:
        image_step(model)
    message = str(info.value)
    # num_batches_tracked += 1 comes first; the running statistics would follow
    assert "the deferred tensor features.1.num_batches_tracked (BatchNorm2d)" in message
    assert "aten.add_.Tensor" in message
    assert "forward pass of CNN" in message
    assert "fake_mode()" in message and "materialize_module(model)" in message
    assert issubclass(DeferredWriteError, RecordingError)
    # nothing changed: the same pass inside fake_mode works, and the values are eager's
    with fake_mode():
        image_step(model).backward()
    materialize_module(model)
    assert_same_tensors(eager(CNN), model)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False),
])
def test_an_optimizer_step_outside_fake_mode_is_refused(make):
    model = deferred(CNN).eval()
    opt = make(model.parameters())
    with pytest.warns(DeferredModuleWarning):
        image_step(model).backward()
    with pytest.raises(DeferredWriteError, match=rf"step of {type(opt).__name__}"):
        opt.step()
    materialize_module(model)
    assert_same_tensors(eager(CNN), model)


def test_writing_fake_results_into_a_deferred_tensor_is_refused():
    model = deferred(CNN).eval()
    with pytest.warns(DeferredModuleWarning):
        out = image_step(model)
    with torch.no_grad(), pytest.raises(DeferredWriteError, match="values computed on fakes"):
        model.head.bias.add_(out)


def _changes(model):
    with torch.no_grad():
        model.head.weight.mul_(2)
    model.features[0].load_state_dict({"weight": torch.full((8, 3, 3, 3), 0.5), "bias": torch.zeros(8)})
    model.half()


def test_changes_outside_a_forward_pass_are_still_recorded_after_one():
    model = deferred(CNN).eval()
    with pytest.warns(DeferredModuleWarning):
        image_step(model)
    _changes(model)
    model.float()
    with fake_mode():
        model(torch.randn(1, 3, 8, 8))  # planning in between changes nothing
        with pytest.raises(MixedFakeError, match="inside fake_mode"):
            model.half()  # a change inside fake_mode cannot be recorded: refused
    reference = eager(CNN).eval()
    _changes(reference)
    reference.float()
    materialize_module(model)
    assert_same_tensors(reference, model)


def test_fake_mode_data_into_a_deferred_tensor_names_where_it_came_from():
    model = deferred(CNN)
    with fake_mode():
        plain = torch.zeros(10)
    with pytest.raises(MixedFakeError) as info:
        model.head.bias.data = plain
    message = str(info.value)
    assert "the new data is a fake made by fake_mode" in message and "Assign a real tensor" in message
    assert "outside fake_mode" not in message  # it is done outside fake_mode already
    assert "inside deferred_init got" not in message  # no deferred_init is running


def test_a_forward_pass_inside_a_constructor_is_recorded_as_before():
    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", self.lin(torch.ones(1, 4)).detach().abs().sum())

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeferredModuleWarning)
        model = deferred(Probe)
    materialize_module(model)
    assert_same_tensors(eager(Probe), model)


def _inference_ones():
    with torch.inference_mode():
        return torch.ones(3)


@pytest.mark.parametrize("action", [
    lambda t: torch.binomial(t, t),         # random, no meta kernel: UnsupportedOperatorError
    lambda t: t.add_(_inference_ones()),    # InferenceTensorInputError
])
def test_errors_after_deferred_init_do_not_claim_to_be_inside_it(action):
    t = deferred_init(torch.ones, 3)
    with pytest.raises(Exception) as info:
        action(t)
    message = str(info.value)
    assert "while constructing" not in message and "inside deferred_init" not in message
    assert "after deferred_init returned" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_value_read_after_deferred_init_says_so():
    from deferinit import DataDependentError

    t = deferred_init(torch.rand, 3, device="cuda")
    with pytest.raises(DataDependentError) as info:
        t.tolist()
    message = str(info.value)
    assert "after deferred_init returned" in message and "while recording" not in message
