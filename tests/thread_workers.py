"""Rank bodies for sharded materialization from several threads (tests/test_threads_materialize.py).

Each rank shards a deferred model with FSDP2 and materializes overlapping
parts of it from several threads at once (forced by tests/overlap.py, the
same roles on every rank), then compares its shards with eager's slices.
Importable by name, as spawn children import it.
"""

from __future__ import annotations

import pytest
import torch

from deferinit import deferred_init, is_deferred
from deferinit.materialize import materialize_module, materialize_tensor
from deferinit.materialize.replay import Replay
from dist_workers import Net, _fully_shard_net, check, shard_of
from overlap import overlapped


def case_fsdp2_threads(rank: int, world_size: int, repeat: int) -> int:
    """Three threads: a block, the whole model and one DTensor parameter, each
    thread first in turn; every shard equals eager's slice, every parameter a
    DTensor whose local tensor is a plain real tensor."""
    torch.manual_seed(0)
    eager = Net()
    reference = {name: p.detach() for name, p in eager.named_parameters()}
    buffers = dict(eager.named_buffers())
    runs = 0
    with pytest.MonkeyPatch.context() as monkeypatch:
        for i in range(repeat):
            torch.manual_seed(0)
            model = deferred_init(Net)
            _fully_shard_net(model)
            calls = [
                lambda: materialize_module(model.blocks[1]),
                lambda: materialize_module(model),
                lambda: materialize_tensor(model.head.weight),
            ]
            k = i % len(calls)
            overlapped(monkeypatch, calls[k], calls[:k] + calls[k + 1:], [(Replay, "run")])
            check(not is_deferred(model), "a tensor stayed deferred")
            for name, p in model.named_parameters():
                check(type(p).__name__ == "DTensor", f"{name} is a {type(p).__name__}")
                local = p._local_tensor
                check(type(local) is torch.Tensor and not is_deferred(local), f"{name}: local is {type(local).__name__}")
                check(torch.equal(local, shard_of(reference[name], rank, world_size)), f"{name} differs from eager's slice")
                check(p.requires_grad, f"{name}: requires_grad lost")
            for name, b in model.named_buffers():
                check(torch.equal(b, buffers[name]), f"buffer {name} differs from eager")
            runs += 1
    return runs
