"""Rank bodies for the multi-process checkpoint tests
(tests/materialize/test_checkpoint_distributed.py), run by :func:`multiproc.run_ranks`.

Each loads a safetensors checkpoint into a deferred, sharded module (before
or after sharding), materializes it, and reports what this rank read from
the file (``rchar`` of ``/proc/self/io``), which kernels ran (``torch.profiler``)
and whether its shards equal the checkpoint's rows.  Checks raise
``AssertionError`` with a message.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import dist_workers
from deferinit import deferred_init, is_deferred
from deferinit.materialize import load_checkpoint, materialize_module

RANDOM = ("uniform_", "normal_", "random_", "bernoulli", "randn", "rand")


class Wide(nn.Module):
    """Rows not divisible by the world size: FSDP2 pads the last shards."""

    def __init__(self, n: int = 3, d: int = 128):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, 2 * d + 1) for _ in range(n))
        self.norm = nn.LayerNorm(2 * d + 1)


def MLP() -> nn.Module:
    """dist_workers' MLP, wide enough that tensor-parallel shards span pages."""
    return dist_workers.MLP(32, 128)


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _materialize_measured(model) -> tuple[int, list[str]]:
    from torch.profiler import ProfilerActivity, profile

    before = rchar()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        materialize_module(model)
    read = rchar() - before
    if is_deferred(model):
        raise AssertionError("materialize_module left deferred tensors")
    return read, [e.name for e in prof.events() if any(k in e.name for k in RANDOM)]


def case_fsdp2(rank: int, world_size: int, path: str, order: str) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = deferred_init(Wide)
    if order == "before":
        load_checkpoint(model, path)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    if order == "after":
        load_checkpoint(model, path)
    read, random = _materialize_measured(model)
    expected = load_file(path)
    for name, p in model.named_parameters():
        chunks = torch.chunk(expected[name], world_size)
        piece = chunks[rank] if rank < len(chunks) else expected[name][:0]
        local = p._local_tensor
        if not torch.equal(local, piece):
            raise AssertionError(f"{name}: rank {rank}'s shard differs from the checkpoint's rows")
        if not torch.equal(p.full_tensor(), expected[name]):
            raise AssertionError(f"{name}: the gathered tensor differs from the checkpoint")
    # Trains like a module loaded eagerly.
    loss = model.layers[0](torch.ones(2, 128)).sum()
    loss.backward()
    return {"read": read, "random": random}


def case_tp(rank: int, world_size: int, path: str, order: str, src_data_rank) -> dict:
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = deferred_init(MLP)
    if order == "before":
        load_checkpoint(model, path)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}, src_data_rank=src_data_rank)
    if order == "after":
        load_checkpoint(model, path)
    read, random = _materialize_measured(model)
    expected = load_file(path)
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if not torch.equal(full.detach(), expected[name]):
            raise AssertionError(f"{name} (src_data_rank={src_data_rank}, load {order}) differs from the checkpoint")
        local = getattr(p, "_local_tensor", p)
        if local.untyped_storage().nbytes() != local.numel() * local.element_size():
            raise AssertionError(f"{name}: the local shard holds {local.untyped_storage().nbytes()} bytes")
    torch.manual_seed(1)
    model(torch.randn(4, 32)).sum().backward()
    return {"read": read, "random": random}


def case_partial_fsdp2(rank: int, world_size: int, path: str) -> dict:
    """A checkpoint without the LayerNorm and the last layer: those keep their
    initialization, equal to eager construction + load_state_dict(strict=False)."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard

    sd = load_file(path)
    torch.manual_seed(0)
    eager = Wide()
    eager.load_state_dict(sd, strict=False)
    torch.manual_seed(0)
    model = deferred_init(Wide)
    result = load_checkpoint(model, path, strict=False)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    materialize_module(model)
    reference = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        if not torch.equal(p.full_tensor(), reference[name].detach()):
            raise AssertionError(f"{name} differs from eager + load_state_dict(strict=False)")
    return {"missing": result.missing_keys}


def case_fsdp1(rank: int, world_size: int, path: str) -> dict:
    """FSDP1 materializes each unit's full tensors before flattening them
    (param_init_fn): loaded before wrapping, the full state dict equals the
    checkpoint; each rank reads the whole file (FSDP1 shards real tensors)."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from deferinit.materialize.distributed import fsdp1_hooks, param_init_fn

    torch.manual_seed(0)
    model = deferred_init(Wide)
    load_checkpoint(model, path)
    before = rchar()
    with fsdp1_hooks():
        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), param_init_fn=param_init_fn,
                       device_id=torch.device("cpu"))
    read = rchar() - before
    with FSDP.state_dict_type(wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
        state = wrapped.state_dict()
    expected = load_file(path)
    for key, value in expected.items():
        if not torch.equal(state[key], value):
            raise AssertionError(f"{key} differs from the checkpoint")
    return {"read": read}


def _eager_sharded(make, path, layout):
    """The eager reference: the module built for real, ``load_state_dict`` of the
    checkpoint, then sharded by ``layout`` (see :func:`dcp_workers.shard`)."""
    from safetensors.torch import load_file

    import dcp_workers

    eager = make()
    eager.load_state_dict(load_file(path))
    return dcp_workers.shard(eager, layout)


def _same_locals(model, reference) -> None:
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        want = expected[name]
        if getattr(p, "placements", None) != getattr(want, "placements", None):
            raise AssertionError(f"{name}: placements {p.placements} where eager has {want.placements}")
        if not torch.equal(getattr(p, "_local_tensor", p).detach(), getattr(want, "_local_tensor", want).detach()):
            raise AssertionError(f"{name}: this rank's piece differs from eager's")


def case_sharded_load(rank: int, world_size: int, path: str, model_name: str, layout: str, order: str) -> dict:
    """A deferred model (seed 0; the checkpoint was saved from seed 7) loaded
    ``before`` or ``after`` sharding by ``layout`` (``tp``: the uneven
    ``Linear(64, 1023)`` colwise; ``2d``: tensor parallel inside FSDP2);
    each rank's pieces equal eager's, no random kernel runs."""
    import dcp_workers

    make = dcp_workers.MODELS[model_name]
    reference = _eager_sharded(make, path, layout)
    torch.manual_seed(0)
    model = deferred_init(make)
    before = rchar()
    if order == "before":
        load_checkpoint(model, path)
    dcp_workers.shard(model, layout)
    if order == "after":
        load_checkpoint(model, path)
    headers = rchar() - before
    read, random = _materialize_measured(model)
    _same_locals(model, reference)
    return {"read": read + headers, "random": random}


def case_divergent_sources(rank: int, world_size: int, paths: list, seeds: list) -> dict:
    """Rank r loads ``paths[r]`` into a deferred MLP seeded ``seeds[r]``, then
    ``parallelize_module`` with the default ``src_data_rank=0``: every rank gets
    rank 0's rows as eager would, or a CollectiveError on every rank."""
    from deferinit.collectives import CollectiveError

    import dcp_workers

    torch.manual_seed(seeds[rank])
    model = deferred_init(dcp_workers.MLP)
    load_checkpoint(model, paths[rank])
    try:
        dcp_workers.shard(model, "tp")
    except CollectiveError as e:
        return {"error": str(e)}
    materialize_module(model)
    # Eager: rank 0's checkpoint, scattered from rank 0.
    _same_locals(model, _eager_sharded(dcp_workers.MLP, paths[0], "tp"))
    return {"error": None}
