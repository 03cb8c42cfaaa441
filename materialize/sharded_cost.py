"""What materializing a sharded module will cost on this rank, from the record alone."""

from __future__ import annotations

from typing import NamedTuple

import torch

from deferinit.ir.graph import Input
from deferinit.view import deferred_tensors
from deferinit.fake.opinfo import op_info

from .sharded import extent_bytes, held_only_by, group_closure, groups


class GroupCost(NamedTuple):
    """What materializing one group of aliasing tensors costs on this rank."""

    names: list  # the tensors (a parameter's shard, FSDP's padded buffer...)
    kept_bytes: int  # memory the group keeps (its storage, compacted)
    transient_bytes: int  # memory its replay allocates and frees again


def sharded_memory_cost(module: torch.nn.Module) -> list[GroupCost]:
    """How :func:`deferinit.materialize.materialize_module` would materialize ``module`` on
    this rank, from the record alone (nothing is allocated): one
    :class:`GroupCost` per replay, in replay order.

    The rank's peak is about ``sum(kept_bytes)`` plus the largest
    ``transient_bytes`` (a full parameter, for FSDP2).  Bytes are estimated
    from the recorded geometry: every operator that is neither a view nor in
    place is counted as allocating its outputs.

    Example::

        >>> cost = sharded_memory_cost(fsdp_model)
        >>> sum(g.kept_bytes for g in cost), max(g.transient_bytes for g in cost)
        (2204760064, 2101346304)
    """
    costs = []
    for group in groups(module, deferred_tensors(module)):
        nodes = group_closure(group)
        shadow_storage = group[0][1]._shadow.untyped_storage().nbytes()
        spans = [extent_bytes(f._shadow) for _, f in group]
        span = max(b for _, b in spans) - min(a for a, _ in spans)
        compacted = span < shadow_storage and held_only_by(group)
        kept = span if compacted else shadow_storage
        # The group's own storage is kept (or, compacted, freed after the copy).
        allocated = shadow_storage if compacted else 0
        storage = group[0][1]._storage
        for value in _values_read(nodes, group):
            if value.storage is not storage:
                allocated += _allocates(value)
        costs.append(GroupCost([name for name, _ in group], kept, allocated))
    return costs


def _values_read(nodes, group):
    values: dict = {}
    for node in nodes:
        for x in node.flat:
            if type(x) is Input:
                values[id(x.value)] = x.value
    for _, fake in group:
        values[id(fake._value)] = fake._value
    return values.values()


def _allocates(value) -> int:
    """Bytes the node creating ``value`` allocates for it (0 for views and in-place results)."""
    node = value.node
    if node.kind == "constant":
        numel = node.payload.numel()
        return numel * node.payload.element_size()
    if node.kind != "op":
        return 0
    info = op_info(node.target)
    if info.view_arg is not None or info.writes:
        return 0
    numel = 1
    for n in value.size:
        numel *= n
    return numel * value.dtype.itemsize


