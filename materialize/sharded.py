"""Materializing modules whose tensors are wrapper subclasses (sharded by FSDP2 or
tensor parallel, quantized): one group at a time, each rank computing its own shards only.

Sharding a deferred module does not need anything special: ``fully_shard``,
``distribute_tensor`` and ``parallelize_module`` cut the fake parameters
with ordinary operators (``split``, ``new_zeros``, ``copy_``, ``narrow``),
and every one of them extends the record.  What this module adds:

* **The fakes FSDP2 holds besides the parameters.**  ``FSDPParam`` keeps the
  padded flat shard (``_sharded_param_data``) of which the DTensor's local
  tensor is a view.  It is materialized in the same replay as the local
  tensor, so the two really alias, as they do eagerly.
* **One parameter at a time.**  A sharded record has every full-tensor
  initialisation before the first cut; replayed as one piece it would hold
  the whole model.  Sharded modules are therefore replayed one storage at a
  time, in the order of their random draws: a rank's peak is its shards
  plus one full parameter.  A shard that is a view of a bigger tensor
  nobody else holds is copied out so the full tensor can be freed.
* **Quantized models alike.**  A quantized tensor (torchao's, NF4) is a
  wrapper subclass computed from a full-precision tensor, like a shard;
  its inner tensors form one group, replayed together (one pass over the
  full-precision tensor), before the next: the peak is the quantized model
  plus one full-precision tensor, where one replay in recorded order would
  make every full-precision weight before quantizing the first.
"""

from __future__ import annotations

import sys

import torch

from deferinit.fake.extent import extent_of
from deferinit.ir.plan import closure, read_of
from deferinit.recorder import is_deferred_fake
from deferinit.wrappers import inner_tensors, is_wrapper


def _holds_wrappers(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is a wrapper subclass (a DTensor,
    a quantized tensor)."""
    for t in module.parameters():
        if is_wrapper(t):
            return True
    for t in module.buffers():
        if is_wrapper(t):
            return True
    return False


def _fsdp_params(module: torch.nn.Module):
    """``(qualified module name, FSDPParam)`` for every FSDP2 unit inside ``module``."""
    if not torch.distributed.is_available():
        return
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return
    for name, sub in module.named_modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()) or ():
            yield name, fsdp_param


# The FSDPParam attributes that may hold a view of the sharded parameter's
# memory (torch 2.4 - 2.13).
_FSDP_PARAM_ATTRS = ("_sharded_param_data", "_sharded_post_forward_param_data")


def fsdp_held_fakes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The deferred fakes FSDP2 keeps for ``module``'s sharded parameters, besides
    the parameters themselves: ``(label, fake)`` pairs.

    Example::

        >>> fully_shard(model)
        >>> [label for label, _ in fsdp_held_fakes(model)]
        ['layers.0.weight (FSDP padded shard)', ...]
    """
    found = []
    names = None
    for unit, fsdp_param in _fsdp_params(module):
        if names is None:
            names = {id(sub): name for name, sub in module.named_modules()}
        info = getattr(fsdp_param, "_module_info", None)
        pname = getattr(info, "param_name", "?")
        prefix = names.get(id(getattr(info, "module", None)), unit)
        label = f"{prefix}.{pname}" if prefix else pname
        for attr in _FSDP_PARAM_ATTRS:
            t = getattr(fsdp_param, attr, None)
            if is_deferred_fake(t):
                kind = "padded shard" if attr == "_sharded_param_data" else "post-forward shard"
                found.append((f"{label} (FSDP {kind})", t))
    return found


class Sharding:
    """The sharding step of :func:`deferinit.materialize.pipeline.materialize`:
    the targets grouped (:func:`groups`: with the fakes FSDP2 holds on their
    storages, one storage or wrapper at a time, in the order of their draws),
    and a group's results copied out of a storage much bigger than they span
    (:func:`compact`)."""

    def __init__(self, module, wrappers=()):
        self.module = module
        self.wrappers = wrappers

    def groups(self, targets) -> list[list]:
        return groups(self.module, targets, self.wrappers)

    def compact(self, group, reals):
        return _compact(group, reals)


def sharding_of(module, wrappers=()) -> Sharding | None:
    """The sharding step for ``module``, or None when it holds no wrapper subclass
    (DTensor, a quantized tensor): then one replay computes everything."""
    return Sharding(module, wrappers) if _holds_wrappers(module) else None


def groups(module, targets, wrappers=()) -> list[list]:
    """The targets plus the fakes FSDP2 holds on their storages, grouped by
    recorded storage (a shard and FSDP's padded buffer go together, so they
    alias) and by wrapper (a quantized tensor's data and scales are computed
    together), in the order of their first random draw."""
    targets = list(targets)
    storages = {id(f._storage) for _, f in targets}
    seen = {id(f) for _, f in targets}
    for label, fake in fsdp_held_fakes(module):
        if id(fake) not in seen and id(fake._storage) in storages:
            seen.add(id(fake))
            targets.append((label, fake))
    # One group per connected set: fakes joined by a storage or a wrapper.
    parent: dict = {}

    def find(k):
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    def join(a, b):
        parent[find(a)] = find(b)

    for _, fake in targets:
        join(("fake", id(fake)), ("storage", id(fake._storage)))
    for w in wrappers:
        for _, inner in inner_tensors(w):
            if id(inner) in seen:
                join(("fake", id(inner)), ("wrapper", id(w)))
    by_group: dict = {}
    for name, fake in targets:
        by_group.setdefault(find(("fake", id(fake))), []).append((name, fake))
    ordered = list(by_group.values())
    ordered.sort(key=lambda group: _first_draw(group_closure(group)))
    return ordered


def group_closure(group) -> list:
    """The recorded nodes the group's tensors are computed from (not counting the
    earlier draws replay may need only to reach a generator state)."""
    return list(closure([read_of(fake) for _, fake in group]).values())


def _first_draw(nodes) -> int:
    """Sequence number of the first random node among ``nodes`` (-1 if none):
    replaying groups in this order replays every draw once."""
    draws = [node.seq for node in nodes if node.rng is not None]
    return min(draws) if draws else -1


def extent_bytes(t: torch.Tensor) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of its storage that ``t`` spans (empty at its offset when zero-size)."""
    size = t.element_size()
    lo = t.storage_offset() * size
    return lo, max(lo, extent_of(t) * size)


def _compact(group, reals):
    """Copy a group's tensors out of a storage much bigger than they span (a shard
    viewing the full tensor), when no other fake can read that storage later.

    Returns ``(reals, compacted)``.
    """
    if not reals or any(r.device.type == "meta" for r in reals):
        return reals, False
    storage = reals[0].untyped_storage()
    if any(r.untyped_storage().data_ptr() != storage.data_ptr() for r in reals):
        return reals, False
    spans = [extent_bytes(r) for r in reals]
    align = max(16, max(r.element_size() for r in reals))
    lo = min(a for a, _ in spans) // align * align
    hi = max(b for _, b in spans)
    if hi - lo >= storage.nbytes() or not held_only_by(group):
        return reals, False
    device = reals[0].device
    mode = torch.inference_mode() if reals[0].is_inference() else torch.no_grad()
    with mode:
        source = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, lo, (hi - lo,), (1,))
        compact = source.clone().untyped_storage()
        out = []
        for r in reals:
            offset = (r.storage_offset() * r.element_size() - lo) // r.element_size()
            out.append(torch.empty(0, dtype=r.dtype, device=device).set_(compact, offset, r.shape, r.stride()))
    return out, True


def held_only_by(group) -> bool:
    """Whether the recorded storage of ``group`` is referenced by its fakes only
    (CPython reference counts: a fake holds its storage in ``__dict__``)."""
    storage = group[0][1]._storage
    held = sum(1 for _, f in group if f.__dict__.get("_storage") is storage)
    # A control object referenced the same way (a local, `held` dicts)
    # calibrates the count for this interpreter.
    control = object()
    holders = [{"_storage": control} for _ in range(held)]
    same = sys.getrefcount(storage) == sys.getrefcount(control)
    del holders
    return same


