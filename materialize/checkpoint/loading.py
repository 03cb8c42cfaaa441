"""Loading matched checkpoint tensors: recorded on deferred tensors, at once on real ones.

A deferred tensor gets a *load node*: a write of its whole value, whose
payload is the checkpoint entry.  It hides every earlier write to the
tensor (its initialisation), and replay reads the file then, only the
parts that are read (see :mod:`deferinit.liveness`).  A sharded tensor
(a DTensor, from ``fully_shard``, ``distribute_tensor`` or
``parallelize_module``) gets the load of the block its placements give this
rank, so each rank reads its own rows only.  A real tensor is loaded at
once, its shard only for a real DTensor.

Everything is checked before anything is recorded or loaded
(:func:`prepare` returns the work, which then cannot fail on a check).
"""

from __future__ import annotations

import torch

from deferinit.errors import CheckpointError, RecordingError
from deferinit.graph import Input, Node
from deferinit.recorder import check_storage_not_real, is_deferred_fake
from fake import is_fake
from fake.flat import flatten

from .blocks import local_block
from .sources import DeferredValue

_SPEC = flatten((None,), {})[1]


def record_load(fake: torch.Tensor, entry) -> Node:
    """Record that ``fake``'s values are ``entry``'s (a write of its whole value).

    Example::

        >>> from materialize.checkpoint.entries import MemorySource
        >>> m = deferred_init(torch.nn.Linear, 2, 2)
        >>> node = record_load(m.bias, MemorySource.entry("bias", torch.ones(2)))
        >>> node.kind, materialize_tensor(m.bias).tolist()
        ('load', [1.0, 1.0])
    """
    storage = fake._storage
    node = Node("load", None, [Input(fake._value, storage.head)], _SPEC, payload=entry)
    node.writes = (0,)
    storage.head = node
    torch._C._increment_version((fake,))
    return node


def _is_dtensor(t) -> bool:
    return getattr(t, "_local_tensor", None) is not None and hasattr(t, "device_mesh")


def prepare(pairs) -> list:
    """Check every ``(key, tensor, entry)`` pair; return the loads to run, in order."""
    work = []
    for key, tensor, entry in pairs:
        target = tensor
        start = None
        if _is_dtensor(tensor):
            target = tensor._local_tensor
            start, sizes = local_block(key, tensor)
            if not isinstance(entry.source, DeferredValue):
                entry = entry.box(start, sizes)
        deferred_source = isinstance(entry.source, DeferredValue)
        geometry = target.__dict__.get("_shadow", target) if is_fake(target) else target
        if torch._debug_has_internal_overlap(geometry) == 1:
            # copy_ (and so load_state_dict) refuses to write such a tensor.
            raise CheckpointError(
                f"cannot load {key}: more than one of its elements refer to a single memory "
                "location (an expanded tensor); load_state_dict refuses it too."
            )
        if is_deferred_fake(target):
            try:
                check_storage_not_real(target, "load_checkpoint")
            except RecordingError as e:
                raise CheckpointError(f"cannot load {key}: {e}") from None
            if deferred_source:
                work.append(_recorded_copy(target, entry.source.tensor, start, target.shape))
            else:
                work.append(lambda t=target, e=entry: record_load(t, e))
        elif is_fake(target):
            raise CheckpointError(
                f"cannot load {key}: it is a fake tensor from fake_mode, not deferred; its values could "
                "never be materialized. Build the module with deferred_init."
            )
        elif target.is_meta:
            raise CheckpointError(
                f"cannot load {key}: it is on the meta device, which holds no values. Build the module "
                "with deferred_init (or call to_empty() first)."
            )
        elif deferred_source:
            raise CheckpointError(
                f"cannot load the deferred state dict value {key!r} into a real tensor; materialize it first."
            )
        else:
            work.append(lambda t=target, e=entry: _load_now(t, e))
    return work


def _load_now(tensor: torch.Tensor, entry) -> None:
    with torch.no_grad():
        entry.read_parts(tensor.detach())


def _recorded_copy(target, value, start, sizes):
    def run():
        piece = value
        if start is not None:
            for dim, (i, n) in enumerate(zip(start, sizes)):
                piece = piece.narrow(dim, i, n)
        with torch.no_grad():
            target.copy_(piece)

    return run
