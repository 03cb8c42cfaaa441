"""Rank bodies for the CUDA checks (``tests/gpu/test_cuda.py``): module-level
functions, as spawn children import them by name."""

from __future__ import annotations

import torch

from deferinit import deferred_init, is_deferred
from dist_workers import Net, _fully_shard_net, check, shard_of
from deferinit.materialize import materialize_module


def case_fsdp2_cuda(rank: int, world_size: int) -> dict:
    """A deferred Net built for CUDA, fully_shard-ed on NCCL ranks and materialized:
    each rank's shards equal eager's slices, the generator after as eager's."""
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    with torch.device(device):
        eager = Net()
    eager_next = torch.rand(4, device=device)

    torch.manual_seed(0)
    with torch.device(device):
        model = deferred_init(Net)
    _fully_shard_net(model)
    check(is_deferred(model), "a sharded deferred module is still deferred")
    materialize_module(model)
    check(torch.equal(torch.rand(4, device=device), eager_next), "the CUDA generator is not where eager left it")
    full = dict(eager.named_parameters())
    for name, p in model.named_parameters():
        local = p._local_tensor
        check(local.device == device, f"{name}: shard on {local.device}")
        check(torch.equal(local, shard_of(full[name].detach(), rank, world_size)), f"{name}: shard differs from eager's slice")
    return {"params": len(full)}
