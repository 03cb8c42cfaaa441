"""Materializing modules sharded across processes: FSDP2, tensor parallel, FSDP1.

The public names of sharded materialization, in one place:
:func:`fsdp_held_fakes` (FSDP2 and tensor
parallel, :mod:`deferinit.materialize.sharded`), :func:`sharded_memory_cost` and
:class:`GroupCost` (:mod:`deferinit.materialize.sharded_cost`), :func:`param_init_fn`
and :func:`fsdp1_hooks` (FSDP1, :mod:`deferinit.materialize.fsdp1`).
:func:`deferinit.materialize.materialize_module` uses the sharded path by itself
whenever a module holds DTensors.

Example (on every rank of a process group)::

    >>> torch.manual_seed(0)
    >>> model = deferred_init(Transformer, config)
    >>> for block in model.layers:
    ...     fully_shard(block)
    >>> fully_shard(model)
    >>> materialize_module(model)      # this rank's shards, exactly eager's slices
"""

from .fsdp1 import fsdp1_hooks, param_init_fn
from .sharded_cost import GroupCost, sharded_memory_cost
from .sharded import fsdp_held_fakes

__all__ = [
    "fsdp1_hooks",
    "fsdp_held_fakes",
    "GroupCost",
    "param_init_fn",
    "sharded_memory_cost",
]

# The former names (a cost estimate, not a plan anything follows), kept for callers.
sharded_memory_plan = sharded_memory_cost
GroupPlan = GroupCost
