"""The planned step's trackers (deferinit.planning.trackers) against PyTorch's own:
MemTracker, FSDPMemTracker and FlopCounterMode, run on the same real steps,
must make the same updates in the same order and give the same figures."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from deferinit.planning import trackers
from deferinit.planning.process_group import fake_ranks
from deferinit.planning.recipe import shard
from deferinit.planning.trackers import Flops, Tracker, fsdp_tracker

from deferinit.planning.step import loss_of

from .test_plan import CORPUS, inputs, llama


def _logged(tracker):
    """``tracker`` with every change of its running totals logged, in order."""
    log = []
    real = tracker._update_snap

    def update(u_type, winfo, old_mem_consumed=None, old_reftype=None):
        log.append((u_type.name, winfo.reftype.name, winfo.mem_consumed, old_mem_consumed,
                    old_reftype.name if old_reftype is not None else None))
        return real(u_type, winfo, old_mem_consumed, old_reftype)

    tracker._update_snap = update
    return tracker, log


def _figures(tracker, log):
    return (tracker.get_tracker_snapshot("peak"), tracker.get_tracker_snapshot(),
            [(s.mod_fqn, s.local_peak, s.snapshots) for s in tracker.memory_tracking.values()],
            list(log))  # as the step left it: storages dying later are not the step's


class _Checkpointed(nn.Module):
    """Two blocks, the second recomputed in the backward pass (the tracker's AC region)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.b = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 16))

    def forward(self, x):
        return checkpoint(self.b, self.a(x), use_reentrant=False).max(dim=-1).values.sum()


class _Lists(nn.Module):
    """Operators returning lists of new tensors (foreach, split copies) that no
    later operator returns: tracked only as those lists."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 48)

    def forward(self, x):
        parts = torch._foreach_mul(list(self.proj(x).split_with_sizes([16, 32], dim=-1)), 2.0)
        copies = torch.split_with_sizes_copy(parts[1], [8, 24], dim=-1)
        return torch.stack([parts[0].sum(), copies[0].sum(), copies[1].mean()]).sum()


class _Unregistered(nn.Module):
    """Blocks in a plain list, not children of the model: PyTorch's ModTracker
    names each by its class, two modules named ``Linear``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.blocks = [nn.Linear(16, 64), nn.Linear(64, 16)]

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.sum()


def _run(make_model, make_inputs, tracker_of, foreach):
    torch.manual_seed(0)
    model = make_model()
    args, kwargs, ids = make_inputs()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    tracker, log = _logged(tracker_of(model, opt))
    # Storages in reference cycles die when the collector runs: not in the same
    # place of two runs, even of PyTorch's tracker against itself.
    gc.collect()
    gc.disable()
    try:
        with tracker:
            loss_of(model(*args, **kwargs), ids).backward()
            opt.step()
            opt.zero_grad()
        figures = _figures(tracker, log)
    finally:
        gc.enable()
    return figures, [p.detach().clone() for p in model.parameters()]


def _memtracker(model, opt, cls):
    tracker = cls()
    tracker.track_external(model, opt)
    return tracker


CASES = {
    **{name: (CORPUS[name], lambda name=name: inputs(name)) for name in sorted(CORPUS)},
    "checkpointed": (_Checkpointed, lambda: ((torch.randn(4, 16),), {}, None)),
    "lists": (_Lists, lambda: ((torch.randn(4, 16),), {}, None)),
    "unregistered": (_Unregistered, lambda: ((torch.randn(4, 16),), {}, None)),
}


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_tracker_makes_memtrackers_updates(name, foreach):
    make_model, make_inputs = CASES[name]
    want = _run(make_model, make_inputs, lambda m, o: _memtracker(m, o, MemTracker), foreach)
    got = _run(make_model, make_inputs, lambda m, o: _memtracker(m, o, Tracker), foreach)
    assert got[0][3] and got[0] == want[0]
    assert all(torch.equal(x, y) for x, y in zip(got[1], want[1], strict=True))


@pytest.mark.parametrize("rank", [0, 3])
def test_the_fsdp_tracker_makes_fsdpmemtrackers_updates(rank):
    """FSDP2 over 4 fake ranks of a real llama: all-gather and reduce-scatter
    buffers, sharded and unsharded parameters and gradients, the optimizer."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    results = []
    for tracker_of in (FSDPMemTracker, fsdp_tracker):
        with fake_ranks(4, rank, "cpu") as mesh:
            def sharded_llama():
                model = llama()
                shard(model, mesh)
                return model

            results.append(_run(sharded_llama, lambda: inputs("llama"), tracker_of, True))
    (want, want_params), (got, got_params) = results
    kinds = {reftype for _, reftype, *_ in got[3]}
    assert {"ALL_GATHER", "REDUCE_SCATTER", "SHARDED_PARAM", "OPT"} <= kinds
    assert got == want
    assert all(torch.equal(x.to_local(), y.to_local()) for x, y in zip(got_params, want_params, strict=True))


def _counted(counter_of, inference):
    torch.manual_seed(0)
    model = llama()
    args, kwargs, ids = inputs("llama")
    mod_tracker = ModTracker()
    counter = counter_of(mod_tracker)
    with mod_tracker if isinstance(counter, Flops) else contextlib.nullcontext(), counter:
        if inference:
            with torch.inference_mode():
                model(*args, **kwargs)
        else:
            loss_of(model(*args, **kwargs), ids).backward()
    return counter.get_total_flops(), counter.get_flop_counts()


@pytest.mark.parametrize("inference", [False, True], ids=["training", "inference_mode"])
def test_the_flop_counter_counts_as_flopcountermode(inference, monkeypatch):
    """Under inference_mode composite operators (linear, ...) reach the counter and
    are decomposed: the same counts, per module and operator, as PyTorch's."""
    monkeypatch.setattr(trackers._FlopMode, "_decomposes", {})
    want = _counted(lambda _: FlopCounterMode(display=False), inference)
    got = _counted(Flops, inference)
    assert got[0] == want[0] > 0
    assert {k: dict(v) for k, v in got[1].items() if v} == {k: dict(v) for k, v in want[1].items() if v}
    if inference:
        assert any(trackers._FlopMode._decomposes.values())  # the decomposing path was taken


def test_each_tensor_visits_results_in_pytrees_order():
    from torch.utils._pytree import tree_map_only

    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    results = [a, (a, None, 3), [b, [c, (d,)]], torch.return_types.max((a, b)), {"x": c, "y": [d, 2.0]}, None, 7,
               "s", torch.float32]
    for result in results:
        want, got = [], []
        tree_map_only(torch.Tensor, lambda t: want.append(t), result)
        trackers._each_tensor(result, lambda reftype, t: got.append((reftype, t)), "ref")
        assert [t for _, t in got] == want and all(r == "ref" for r, _ in got)
        assert [id(t) for _, t in got] == [id(t) for t in want]


def test_the_tracker_measures_a_compiled_model_as_memtracker():
    """torch.compile inside the tracked step: Dynamo does not trace into either
    tracker's dispatch, and the figures are equal."""
    def compiled():
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        torch._dynamo.reset()
        model.compile(backend="eager")
        return model

    make_inputs = CASES["checkpointed"][1]
    want = _run(compiled, make_inputs, lambda m, o: _memtracker(m, o, MemTracker), False)
    got = _run(compiled, make_inputs, lambda m, o: _memtracker(m, o, Tracker), False)
    assert got[0][3] and got[0] == want[0]


def _alone_in_pytorchs_trackers(name):
    """Peak and FLOPs of one AdamW step, PyTorch's MemTracker inside its FlopCounterMode."""
    torch.manual_seed(0)
    model = CORPUS[name]()
    args, kwargs, ids = inputs(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tracker, counter = MemTracker(), FlopCounterMode(display=False)
    tracker.track_external(model, opt)
    with counter, tracker:
        loss_of(model(*args, **kwargs), ids).backward()
        opt.step()
        opt.zero_grad()
    return tracker.get_tracker_snapshot("peak"), counter.get_total_flops()


def test_steps_measured_in_two_threads_at_once_are_each_measured_alone():
    """PyTorch's trackers see modules through global module hooks: two steps
    measured at the same time would each count the other's modules (or fail
    in PyTorch's ModTracker), so measure_step measures one step at a time."""
    import threading

    from deferinit.planning.step import measure_step

    names = ["llama", "gpt2"]
    want = [_alone_in_pytorchs_trackers(name) for name in names]
    start = threading.Barrier(len(names))
    got, errors = {}, []

    def measure(name):
        try:
            torch.manual_seed(0)
            model = CORPUS[name]()
            args, kwargs, ids = inputs(name)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
            start.wait()
            m = measure_step(model, args, kwargs, opt, token_ids=ids)
            got[name] = (m.tracker.get_tracker_snapshot("peak"), m.flops)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    for _ in range(3):
        threads = [threading.Thread(target=measure, args=(name,)) for name in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert [got[name] for name in names] == want
