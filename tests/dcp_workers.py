"""Rank bodies for the distributed-checkpoint tests (tests/materialize/test_checkpoint_dcp_distributed.py),
run by :func:`multiproc.run_ranks`.

A checkpoint is saved by eager PyTorch (``dcp.save`` of a sharded eager
model on N ranks); it is loaded on M ranks with ``load_checkpoint`` into a
deferred model, before or after sharding, and each rank's tensors are
compared with eager's reference: the same model, sharded the same way,
filled by ``dcp.load``.  Each rank reports the bytes it read from files
(``rchar`` of ``/proc/self/io``) in ``load_checkpoint`` (metadata and chunk
headers) and while materializing (tensors), the bytes of the pieces it
keeps, and the random kernels that ran.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import checkpoint_workers
from deferinit import deferred_init, is_deferred
from deferinit.materialize import load_checkpoint, materialize_module

rchar = checkpoint_workers.rchar
RANDOM = checkpoint_workers.RANDOM


class Wide(nn.Module):
    """Rows not divisible by 2 or 4 (FSDP2 pads), wide enough that chunk headers are small."""

    def __init__(self, n: int = 3, d: int = 256):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, 2 * d + 1) for _ in range(n))
        self.norm = nn.LayerNorm(2 * d + 1)


class MLP(nn.Module):
    """Tensor parallel: ``up`` colwise, ``down`` rowwise (uneven rows: 1023)."""

    def __init__(self, d: int = 64, hidden: int = 1023):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


MODELS = {"wide": Wide, "mlp": MLP}


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


def _mesh(layout: str):
    """``(dp mesh or None, tp mesh or None)`` for ``layout`` on this world."""
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    if layout == "fsdp":
        return init_device_mesh("cpu", (world,)), None
    if layout == "tp":
        return None, init_device_mesh("cpu", (world,))
    if layout == "2d":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"]
    return None, None


def shard(model: nn.Module, layout: str) -> nn.Module:
    """Shard ``model`` by ``layout``: ``fsdp`` (FSDP2 per layer and root), ``tp``
    (the MLP's colwise/rowwise plan), ``2d`` (tensor parallel inside FSDP2), or ``none``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    dp, tp = _mesh(layout)
    if tp is not None:
        parallelize_module(model, tp, _tp_plan())
    if dp is not None:
        for layer in getattr(model, "layers", ()):
            fully_shard(layer, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def case_save(rank: int, world_size: int, model_name: str, layout: str, path: str) -> dict:
    """Eager model (seed 7), sharded by ``layout``, saved with ``dcp.save``."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(7)
    model = shard(MODELS[model_name](), layout)
    dcp.save(model.state_dict(), checkpoint_id=path)
    return {"saved": True}


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t).detach()


def case_load(rank: int, world_size: int, model_name: str, layout: str, path: str, order: str) -> dict:
    """``load_checkpoint`` into the deferred model (seed 0) ``before`` or ``after``
    sharding it by ``layout``; compared with eager: the model sharded the same
    way, filled by ``dcp.load``."""
    import torch.distributed.checkpoint as dcp
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    reference = shard(MODELS[model_name](), layout)
    state = reference.state_dict()
    dcp.load(state, checkpoint_id=path)

    with profile(activities=[ProfilerActivity.CPU]):
        pass  # the profiler's first start reads files of its own

    # The chunks whose layout this rank reads (file's inode, position), while
    # loading and materializing the deferred model.
    from deferinit.materialize.checkpoint import dcp as source

    layouts, chunk_layout = [], source.chunk_layout

    def counted(f, start, length, what):
        layouts.append((os.fstat(f.fileno()).st_ino, start))
        return chunk_layout(f, start, length, what)

    source.chunk_layout = counted
    torch.manual_seed(0)
    model = deferred_init(MODELS[model_name])
    headers = 0
    if order == "before":
        before = rchar()
        load_checkpoint(model, path)
        headers = rchar() - before
    shard(model, layout)
    if order == "after":
        before = rchar()
        load_checkpoint(model, path)
        headers = rchar() - before
    before = rchar()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        materialize_module(model)
    read = rchar() - before
    source.chunk_layout = chunk_layout
    if is_deferred(model):
        raise AssertionError("materialize_module left deferred tensors")
    random = [e.name for e in prof.events() if any(k in e.name for k in RANDOM)]
    expected = dict(reference.named_parameters())
    expected.update(reference.named_buffers())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        want = expected[name]
        if type(t) is not type(want) or getattr(t, "placements", None) != getattr(want, "placements", None):
            raise AssertionError(f"{name}: {type(t).__name__} {getattr(t, 'placements', '')} where eager has "
                                 f"{type(want).__name__} {getattr(want, 'placements', '')}")
        if not torch.equal(_local(t), _local(want)):
            raise AssertionError(f"{name}: rank {rank}'s tensor differs from eager's after dcp.load")
    if order == "after":
        # A real sharded model (eager FSDP2 / DTensor parameters) loads at once, its own blocks.
        torch.manual_seed(0)
        real = shard(MODELS[model_name](), layout)
        load_checkpoint(real, path)
        for name, t in list(real.named_parameters()) + list(real.named_buffers()):
            if not torch.equal(_local(t), _local(expected[name])):
                raise AssertionError(f"{name}: the real sharded model's tensor differs from dcp.load's")
    return {"headers": headers, "read": read, "own": own_bytes(model), "random": random, "layouts": layouts}


def own_bytes(model: nn.Module) -> int:
    """The bytes of the pieces this rank keeps (a replicated tensor whole)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(_local(t).numel() * t.element_size() for t in tensors)
