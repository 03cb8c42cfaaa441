"""The block of the full tensor a DTensor holds on this rank, for a checkpoint load.

A DTensor's placements say which indices of the full tensor its local
tensor holds: ``Replicate`` all of them, ``Shard(d)`` this rank's chunk of
dimension ``d``, and ``_StridedShard`` (what ``fully_shard`` gives a
tensor-parallel parameter on a 2-D mesh: FSDP's shard of the TP piece)
an interleaved selection.  DTensor computes the global index of every
local row per dimension (``torch.distributed.tensor._utils``); when those
indices are consecutive in every dimension the local tensor is a *block*
of the full tensor, and a checkpoint load reads just that block.  A
selection that is not one block (a ``_StridedShard`` that interleaves) or
a ``Partial`` placement (the local tensor is a summand, not a piece) is
refused with a clear error: load before sharding then.

Example::

    >>> fully_shard(model, mesh=mesh["dp"])   # after parallelize_module on mesh["tp"]
    >>> local_block("up.weight", model.up.weight)   # rank (dp=1, tp=0) of a 2 x 2 mesh
    ((32, 0), (32, 32))
"""

from __future__ import annotations

import torch

from .errors import CheckpointError


def local_block(key: str, tensor) -> tuple[tuple, tuple]:
    """``(start, sizes)``: the block of the full tensor a DTensor holds on this rank."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shards = (Shard, _StridedShard)
    placements = list(tensor.placements)
    mesh = tensor.device_mesh

    def refuse(why):
        return CheckpointError(
            f"{key} is sharded with placements {placements}: {why}, so load_checkpoint cannot read "
            "it as a block of the checkpoint's tensor. Call load_checkpoint before sharding (each "
            "rank then still reads only its own part)."
        )

    if any(not isinstance(p, (*shards, Replicate)) for p in placements):
        raise refuse("only Shard, _StridedShard and Replicate placements hold pieces of the full tensor")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise refuse("this rank is not in its device mesh")
    shape = list(tensor.shape)
    indices: dict = {}
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, shards):
            continue
        dim = placement.dim
        size, index = _shard(shape[dim], mesh.size(mesh_dim), coordinate[mesh_dim], placement,
                             indices.get(dim), tensor.shape[dim])
        shape[dim] = size
        indices[dim] = index if size else None
    start = [0] * len(shape)
    for dim, index in indices.items():
        if index is None:
            continue
        first = int(index[0])
        if not torch.equal(index, torch.arange(first, first + len(index), dtype=index.dtype)):
            raise refuse(f"this rank's indices of dimension {dim} are not consecutive")
        start[dim] = first
    if tuple(shape) != tuple(tensor._local_tensor.shape):
        raise CheckpointError(
            f"{key}: this rank holds {list(tensor._local_tensor.shape)}, its placements say {shape}."
        )
    return tuple(start), tuple(shape)


def _shard(length, chunks, rank, placement, previous, full_length):
    """``(size, global indices)`` of this rank's part of a dimension of ``length``
    (already cut by earlier mesh dimensions down to ``previous`` indices), by
    DTensor's own rule for ``placement``."""
    from torch.distributed.tensor import _utils

    size, index = _utils._get_shard_size_and_offsets(length, chunks, rank, placement, previous, full_length, False)
    return size, index[:size]  # a tensor: a row's indices one by one in Python took 1 ms per parameter
