"""Materializing modules sharded across processes: FSDP2, tensor parallel, FSDP1.

Sharding a deferred module does not need anything special: ``fully_shard``,
``distribute_tensor`` and ``parallelize_module`` cut the fake parameters
with ordinary operators (``split``, ``new_zeros``, ``copy_``, ``narrow``),
and every one of them extends the record.  Each rank records the same
full-tensor initialisation (same program, same seed) followed by the cut of
its own shard, so replaying the record gives each rank exactly the slice of
the tensor eager construction would have made, whatever the rank.

What this module adds to :func:`materialize.materialize_module`:

* **The fakes FSDP2 holds besides the parameters.**  ``FSDPParam`` keeps the
  padded flat shard (``_sharded_param_data``) of which the DTensor's local
  tensor is a view.  It is materialized in the same replay as the local
  tensor, so the two really alias, as they do eagerly, and FSDP's lazy
  re-padding (``reset_sharded_param``) finds them the same memory.
* **One parameter at a time.**  A record replays in recorded order, and a
  sharded record has every full-tensor initialisation before the first
  cut; replayed as one piece it would hold the whole model.  Sharded
  modules are therefore replayed one storage at a time, in the order of
  their random draws (each replay starts from the generator states the
  previous ones learned, and a draw that a later fill of the same tensor
  hides is not computed again): a rank's peak is its shards plus one full
  parameter.  A shard that is a view of a bigger tensor nobody else holds
  (``distribute_tensor(..., src_data_rank=None)`` with ``Shard(0)``) is
  copied out so the full tensor can be freed.
* **Collectives** that DTensor issues while distributing a deferred tensor
  are recorded as local operations by :mod:`deferinit.collectives`.
* **FSDP1.**  :func:`param_init_fn` for ``FullyShardedDataParallel`` and
  :func:`fsdp1_hooks`, which lets FSDP1 notice deferred modules at all.

Example (on every rank of a process group)::

    >>> torch.manual_seed(0)
    >>> model = deferred_init(Transformer, config)
    >>> for block in model.layers:
    ...     fully_shard(block)
    >>> fully_shard(model)
    >>> materialize_module(model)      # this rank's shards, exactly eager's slices
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from typing import NamedTuple

import torch

from deferinit.graph import Input
from deferinit.patches import SharedPatch
from deferinit.recorder import is_deferred_fake
from deferinit.replay import Replay, closure, read_of
from fake.opinfo import op_info

__all__ = [
    "fsdp1_hooks",
    "fsdp_held_fakes",
    "GroupPlan",
    "materialize_sharded",
    "param_init_fn",
    "sharded_memory_plan",
]


# -- finding what is sharded -------------------------------------------------------


def _dtensor_class():
    # No DTensor can exist before its module was imported (and importing it
    # costs a fraction of a second): look it up, never import it here.
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def _has_dtensors(module: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is a DTensor."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return False
    for t in module.parameters():
        if isinstance(t, dtensor):
            return True
    for t in module.buffers():
        if isinstance(t, dtensor):
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


# -- materializing group by group -----------------------------------------------------


def materialize_sharded(module, targets, *, device=None, inference=False, progress=None, complete=False) -> bool:
    """Materialize ``targets`` (``(name, fake)`` pairs of ``module``) one storage at a time.

    Called by :func:`materialize.materialize_module`; returns False, doing
    nothing, when ``module`` holds no DTensor (the caller then replays
    everything at once).  Fakes FSDP2 holds for the targets are added.
    Every result is computed before anything is swapped in: on failure the
    module is left as it was.

    Example::

        >>> fully_shard(model)
        >>> materialize_sharded(model, [("w", model.w._local_tensor)])
        True
    """
    if not _has_dtensors(module):
        return False
    from .api import _hand_over_generators, _progress_bar, _streams_to_finish, remember_real_storages
    from .swap import dress, swap_all

    groups = _groups(module, targets)
    targets = [t for group in groups for t in group]
    records = {id(f._record): f._record for _, f in targets}
    finish = _streams_to_finish(records.values()) if complete and device is None else []

    bar = _progress_bar(progress, len(targets))
    computed = []  # (group, reads, reals, compacted)
    try:
        for done, group in enumerate(groups):
            reads = [read_of(f) for _, f in group]
            replay = Replay(reads, device=device, inference=inference, labels=[name for name, _ in group])
            _skip_hidden_fills(replay)
            reals = replay.run()
            del replay
            reals, compacted = _compact(group, reals)
            computed.append((group, reads, reals, compacted))
            if bar is not None:
                bar.update_to(done + 1, len(groups))
        if finish:
            Replay([], device=device, inference=inference, extra=finish).run()
    finally:
        if bar is not None:
            bar.close()

    pairs = []
    for group, _, reals, _ in computed:
        for (_, fake), real in zip(group, reals):
            pairs.append((fake, dress(fake, real, inference)))
    storages_after = [[f._storage for _, f in group] for group, _, _, _ in computed]
    swap_all(pairs)

    for (group, reads, reals, compacted), group_storages in zip(computed, storages_after):
        if compacted:
            continue  # nothing else can read that storage (see _compact)
        remember_real_storages(reads, group_storages, reals)
    if device is None:
        _hand_over_generators(None, records.values())
    return True


def _groups(module, targets) -> list[list]:
    """The targets plus the fakes FSDP2 holds on their storages, grouped by
    recorded storage (a shard and FSDP's padded buffer go together, so they
    alias), in the order of their first random draw."""
    targets = list(targets)
    storages = {id(f._storage) for _, f in targets}
    seen = {id(f) for _, f in targets}
    for label, fake in fsdp_held_fakes(module):
        if id(fake) not in seen and id(fake._storage) in storages:
            seen.add(id(fake))
            targets.append((label, fake))
    groups: dict[int, list] = {}
    for name, fake in targets:
        groups.setdefault(id(fake._storage), []).append((name, fake))
    ordered = list(groups.values())
    ordered.sort(key=lambda group: _first_draw(_closure(group)))
    return ordered


def _closure(group) -> list:
    """The recorded nodes the group's tensors are computed from (not counting the
    earlier draws replay may need only to reach a generator state)."""
    return list(closure([read_of(fake) for _, fake in group]).values())


def _first_draw(nodes) -> int:
    """Sequence number of the first random node among ``nodes`` (-1 if none):
    replaying groups in this order replays every draw once."""
    draws = [node.seq for node in nodes if node.rng is not None]
    return min(draws) if draws else -1


class GroupPlan(NamedTuple):
    """What materializing one group of aliasing tensors costs on this rank."""

    names: list  # the tensors (a parameter's shard, FSDP's padded buffer...)
    kept_bytes: int  # memory the group keeps (its storage, compacted)
    transient_bytes: int  # memory its replay allocates and frees again


def sharded_memory_plan(module: torch.nn.Module) -> list[GroupPlan]:
    """How :func:`materialize.materialize_module` would materialize ``module`` on
    this rank, from the record alone (nothing is allocated): one
    :class:`GroupPlan` per replay, in replay order.

    The rank's peak is about ``sum(kept_bytes)`` plus the largest
    ``transient_bytes`` (a full parameter, for FSDP2).  Bytes are estimated
    from the recorded geometry: every operator that is neither a view nor in
    place is counted as allocating its outputs.

    Example::

        >>> plan = sharded_memory_plan(fsdp_model)
        >>> sum(g.kept_bytes for g in plan), max(g.transient_bytes for g in plan)
        (2204760064, 2101346304)
    """
    from deferinit.view import deferred_tensors

    plans = []
    for group in _groups(module, deferred_tensors(module)):
        nodes = _closure(group)
        shadow_storage = group[0][1]._shadow.untyped_storage().nbytes()
        spans = [_extent_bytes(f._shadow) for _, f in group]
        span = max(b for _, b in spans) - min(a for a, _ in spans)
        compacted = span < shadow_storage and _held_only_by(group)
        kept = span if compacted else shadow_storage
        # The group's own storage is kept (or, compacted, freed after the copy).
        allocated = shadow_storage if compacted else 0
        storage = group[0][1]._storage
        for value in _values_read(nodes, group):
            if value.storage is not storage:
                allocated += _allocates(value)
        plans.append(GroupPlan([name for name, _ in group], kept, allocated))
    return plans


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


_aten = torch.ops.aten
# In-place fills that write every element of their tensor without reading it.
_FILLS = frozenset({
    _aten.uniform_.default, _aten.normal_.default, _aten.fill_.Scalar, _aten.zero_.default,
    _aten.bernoulli_.float, _aten.exponential_.default, _aten.log_normal_.default,
    _aten.cauchy_.default, _aten.geometric_.default,
})


def _skip_hidden_fills(replay) -> int:
    """Drop from a replay's plan the fills that a later fill of the same tensor hides.

    A constructor draws a parameter (``reset_parameters``) and a model-level
    initialiser draws it again (transformers' ``_init_weights``).  Replaying
    one parameter at a time, the first draw of each is computed once while
    replaying an earlier parameter (to reach the generator state of the
    second draws) and would be computed again for its own parameter, whose
    value it cannot change.  A fill is skipped when the next write to its
    tensor is a fill of exactly the same elements, nothing reads the tensor
    in between, and the generator state after it is already known.  Returns
    how many were skipped (0 whenever the plan does not look as expected).
    """
    try:
        order = replay.order
        readers: dict = {}
        for node in order:
            for x in node.flat:
                if type(x) is Input and x.version is not None:
                    readers[id(x.version)] = readers.get(id(x.version), 0) + 1
        for read in replay.targets:
            if read.version is not None:
                readers[id(read.version)] = readers.get(id(read.version), 0) + 1
        planned = {id(n) for n in order}
        hidden = set()
        for node in order:
            if node.kind != "op" or node.target not in _FILLS or node.writes != (0,):
                continue
            read = node.flat[0]
            earlier = read.version if type(read) is Input else None
            if earlier is None or id(earlier) not in planned or readers.get(id(earlier)) != 1:
                continue
            if earlier.kind != "op" or earlier.target not in _FILLS or earlier.writes != (0,):
                continue
            a, b = earlier.flat[0].value, read.value
            if (a.size, a.stride, a.offset, a.dtype) != (b.size, b.stride, b.offset, b.dtype):
                continue
            if earlier.rng is not None:
                stream = replay.streams[id(earlier.rng[0]())]
                if stream.state_before(stream.index[id(earlier)] + 1) is None:
                    continue
            hidden.add(id(earlier))
        if hidden:
            replay.order = [n for n in order if id(n) not in hidden]
        return len(hidden)
    except (AttributeError, KeyError, TypeError, IndexError):
        return 0


def _extent_bytes(t: torch.Tensor) -> tuple[int, int]:
    size = t.element_size()
    if t.numel() == 0:
        return t.storage_offset() * size, t.storage_offset() * size
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (t.storage_offset() + last + 1) * size


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
    spans = [_extent_bytes(r) for r in reals]
    align = max(16, max(r.element_size() for r in reals))
    lo = min(a for a, _ in spans) // align * align
    hi = max(b for _, b in spans)
    if hi - lo >= storage.nbytes() or not _held_only_by(group):
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


def _held_only_by(group) -> bool:
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


# -- FSDP1 ------------------------------------------------------------------------


def param_init_fn(module: torch.nn.Module) -> None:
    """FSDP1's ``param_init_fn``: materialize ``module``'s own deferred parameters
    and buffers (not its children's), as ``FullyShardedDataParallel`` expects.

    FSDP1 calls it for every module of a unit before flattening the unit's
    parameters; it only calls it for modules it recognises as not yet
    initialised, so build the FSDP instance inside :func:`fsdp1_hooks`.

    Example::

        >>> model = deferred_init(Net)
        >>> with fsdp1_hooks():
        ...     model = FSDP(model, auto_wrap_policy=policy, param_init_fn=param_init_fn,
        ...                  device_id=torch.device("cpu"))
    """
    from .api import materialize_module

    materialize_module(module, check_fn=lambda sub: sub is module)


def _fsdp1_is_fake(t) -> bool:
    from deferinit import is_deferred

    return isinstance(t, torch.Tensor) and is_deferred(t)


def _fsdp1_materialize_module(module, check_fn=None):
    from .api import materialize_module

    return materialize_module(module, check_fn=check_fn)


_FSDP1_FAKE = types.SimpleNamespace(is_fake=_fsdp1_is_fake)
_FSDP1_DEFERRED_INIT = types.SimpleNamespace(materialize_module=_fsdp1_materialize_module)
_FSDP1_HOOKS = SharedPatch(
    lambda: importlib.import_module("torch.distributed.fsdp._init_utils"),
    lambda module: {"_TORCHDISTX_AVAIL": True, "fake": _FSDP1_FAKE, "deferred_init": _FSDP1_DEFERRED_INIT},
)


@contextlib.contextmanager
def fsdp1_hooks():
    """Let ``FullyShardedDataParallel`` (FSDP1) recognise deferred modules.

    FSDP1 materializes a unit before flattening it only when its parameters
    are on the meta device or are torchdistX fakes.  Inside this block,
    deferinit takes torchdistX's place: FSDP1 then calls your
    ``param_init_fn`` (use :func:`param_init_fn`) for every module of a
    deferred unit, or, without one, materializes the unit with
    ``materialize_module(unit, check_fn=...)`` itself.  The hook is installed
    in ``torch.distributed.fsdp._init_utils`` for the block only (nesting and
    threads safe); wrap only the FSDP constructor in it.

    Example::

        >>> with fsdp1_hooks():
        ...     model = FSDP(deferred_init(Net), param_init_fn=param_init_fn,
        ...                  device_id=torch.device("cpu"))
    """
    with _FSDP1_HOOKS.held():
        yield
