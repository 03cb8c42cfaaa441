"""Planning a training step (issue 13), checked against reality.

PyTorch's MemTracker and FlopCounterMode measure one training step of a
deferred model inside fake_mode; the figures must equal those of the same
step run for real on CPU (the model built eagerly), and those of PyTorch's
own FakeTensorMode where it can run.  The per-module figures and FSDP2's
(FSDPMemTracker over a fake process group) too.
"""

import contextlib
import math

import pytest
import torch
import torch.nn as nn

from deferinit import deferred_init
from deferinit.planning.process_group import fake_ranks
from deferinit.planning.recipe import shard
from deferinit.planning.report import module_rows
from deferinit.planning.step import Tracker, measure_step, module_peak
from deferinit.fake import fake_mode

B, S = 2, 16


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=500, max_position_embeddings=64))


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=64))


def transformer():
    return nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                          batch_first=True, dropout=0.0)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


CORPUS = {"llama": llama, "gpt2": gpt2, "transformer": transformer, "cnn": CNN}


def inputs(name, device="cpu"):
    """(args, kwargs, token ids), made inside whatever mode is active."""
    if name in ("llama", "gpt2"):
        ids = torch.randint(0, 500, (B, S), device=device)
        return (), {"input_ids": ids, "labels": ids}, ids
    if name == "transformer":
        return (torch.randn(B, S, 32, device=device), torch.randn(B, S, 32, device=device)), {}, None
    return (torch.randn(B, 3, 16, 16, device=device),), {}, None


def step(name, model, foreach, device="cpu", sharded=False):
    model.train()
    args, kwargs, ids = inputs(name, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    return measure_step(model, args, kwargs, opt, token_ids=ids, sharded=sharded)


def real(name, foreach):
    torch.manual_seed(0)
    model = CORPUS[name]()
    return model, step(name, model, foreach)


def planned(name, foreach):
    torch.manual_seed(0)
    model = deferred_init(CORPUS[name])
    with fake_mode():
        return model, step(name, model, foreach)


def per_module(model, measured):
    out = {}
    for label, modules in [("(whole model)", [model])] + module_rows(model):
        out[label] = [module_peak(measured, m, torch.device("cpu")) for m in modules]
    return out


@pytest.mark.parametrize("foreach", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(CORPUS))
def test_peak_and_flops_of_a_planned_step_equal_the_real_run(name, foreach):
    real_model, want = real(name, foreach)
    fake_model, got = planned(name, foreach)
    assert got.peak == want.peak  # per device, per category, byte for byte
    assert got.after == want.after  # what stays between steps
    assert got.flops == want.flops > 0
    assert per_module(fake_model, got) == per_module(real_model, want)
    assert any(v is not None for rows in per_module(fake_model, got).values() for v in rows)


def _fake_tensor_mode_model(name, mode):
    if name == "transformer":
        # nn.Transformer cannot be constructed under FakeTensorMode; convert a real one.
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            model = transformer()
        for m in model.modules():
            for k, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[k] = nn.Parameter(mode.from_tensor(p), requires_grad=p.requires_grad)
        return model
    return CORPUS[name]()


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_planned_figures_equal_pytorch_fake_tensor_mode(name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    with FakeTensorMode() as mode:
        theirs = step(name, _fake_tensor_mode_model(name, mode), foreach=False)
    _, ours = planned(name, foreach=False)
    assert ours.peak == theirs.peak and ours.flops == theirs.flops


def test_the_flop_counter_gives_flopcountermodes_figures():
    """The step's FlopCounterMode shares the memory tracker's ModTracker: the same
    total and the same per-module forward counts as PyTorch's own."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = llama()
    args, kwargs, ids = inputs("llama")
    counter = FlopCounterMode(display=False)
    with counter:
        out = model(*args, **kwargs)
        forward = counter.get_flop_counts()
        out.loss.backward()
    torch.manual_seed(0)
    model = llama()
    args, kwargs, ids = inputs("llama")
    ours = measure_step(model, args, kwargs, torch.optim.SGD(model.parameters(), lr=0.1), token_ids=ids)
    assert ours.flops == counter.get_total_flops() > 0
    assert {k: v for k, v in ours.forward_flops.items() if v} == {k: v for k, v in forward.items() if v}


def _sharded(planned_, rank):
    torch.manual_seed(0)
    with fake_ranks(4, rank, "cpu") as mesh:
        if planned_:
            model = deferred_init(llama)
            ctx = fake_mode()
        else:
            model = llama()
            ctx = contextlib.nullcontext()
        with ctx:
            shard(model, mesh)
            return step("llama", model, foreach=False, sharded=True)


@pytest.mark.parametrize("rank", [0, 3])
def test_fsdp2_rank_figures_equal_the_real_run(rank):
    got, want = _sharded(True, rank), _sharded(False, rank)
    assert got.peak == want.peak and got.flops == want.flops
    cpu = got.peak[torch.device("cpu")]
    assert cpu["SHARDED_PARAM"] > 0 and cpu["ALL_GATHER"] > 0 and cpu["UNSHARDED_PARAM"] > 0


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_a_training_step_on_fake_cuda(name):
    """On this CPU-only build: the step runs on fake cuda:0, MemTracker rounds each
    CUDA storage to 512 bytes, and the FLOPs are the CPU run's."""
    _, on_cpu = planned(name, foreach=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = deferred_init(CORPUS[name])
    with fake_mode(fake_cuda=True):
        got = step(name, model, foreach=True, device="cuda")
    cuda = torch.device("cuda", 0)
    assert got.flops == on_cpu.flops
    assert set(got.peak) <= {cuda, torch.device("cpu")}
    assert got.peak[cuda]["Total"] % 512 == 0
    params = {id(p): p for p in model.parameters()}.values()
    assert got.peak[cuda]["PARAM"] == sum(math.ceil(p.numel() * p.element_size() / 512) * 512 for p in params)
    # only the optimizer's step counters stay on the CPU, as in PyTorch
    assert set(k for k, v in got.peak.get(torch.device("cpu"), {}).items() if v and k != "Total") <= {"OPT"}


def test_the_trackers_index_of_running_modules_follows_every_way_of_adding_stats():
    """Tracker finds a running module's stats by name: the index beside
    memory_tracking sees entries added by item, setdefault and update, and clear."""
    from torch.distributed._tools.mem_tracker import _ModMemStats

    tracker = Tracker()
    table = tracker.memory_tracking
    a, b, c = nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1)
    table[a] = _ModMemStats("a")
    table.setdefault(b, _ModMemStats("b"))
    table.update({c: _ModMemStats("c")})
    d = nn.Linear(1, 1)
    table[d] = _ModMemStats("a")  # a second module of that name: both are indexed
    indexed = {name: [stats for _, stats in same.values()] for name, same in table.by_name.items()}
    assert {name: [s.mod_fqn for s in stats] for name, stats in indexed.items()} == {"a": ["a", "a"], "b": ["b"], "c": ["c"]}
    assert all(any(t is s for t in indexed[s.mod_fqn]) for s in table.values())
    table.clear()
    assert not table.by_name and not list(table.values())
