"""``materialize_tensor`` and ``materialize_module``: what to make real, handed to the pipeline."""

from __future__ import annotations

import gc

import torch

from deferinit.exclusive import exclusive
from deferinit.fake.guard import Entry, restoring
from deferinit.fake.locking import locked
from deferinit.fake.tensor import FakeTensor, is_fake
from deferinit.holdings import attached, holdings
from deferinit.recorder import is_deferred_fake
from deferinit.wrappers import deferred_fakes_of, is_wrapper, wrapper_layers

from .errors import AutogradMaterializationError
from .pipeline import materialize
from .sharded import sharding_of


def materialize_tensor(tensor: torch.Tensor, *, device=None, inference: bool = False) -> torch.Tensor:
    """Make a deferred tensor real, in place, and return it.

    The tensor object itself becomes real (``torch.utils.swap_tensors``):
    every reference to it (module attributes, an optimizer, a tied module)
    now sees real memory with exactly the values eager construction would
    have produced.  A real or plain fake tensor is returned as it is, and a
    second call is a no-op (also one that waited for another thread's
    materialization of the same tensor).  ``device=`` materializes on another
    device than the recorded one; ``inference=True`` gives inference tensors.
    A wrapper subclass (a quantized tensor, a DTensor) is rebuilt around its
    materialized inner tensors; the tensors a tensor carries as attributes
    (bitsandbytes' ``SCB``) are materialized with it.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 4, 4)
        >>> w = m.weight
        >>> materialize_tensor(w) is w, is_deferred(w)
        (True, False)
    """
    # Another thread may be materializing it: decided once it is done.
    locked(exclusive(), _materialize_tensor, tensor, device, inference)
    return tensor


def _materialize_tensor(tensor, device, inference) -> None:
    targets = deferred_fakes_of(tensor, "tensor")
    wrappers = _wrappers_of(tensor, "tensor")
    # What the tensor carries (bitsandbytes' SCB; see deferinit.holdings.attached).
    for name, t in attached(tensor):
        for label, fake in deferred_fakes_of(t, name):
            if all(fake is not f for _, f in targets):
                targets.append((label, fake))
        wrappers += [w for w in _wrappers_of(t, name) if all(w is not x for x in wrappers)]
    if not targets:
        return
    # An interrupted call leaves the thread as it found it, collector included (deferinit.fake.guard).
    restoring(Entry(), _collector_paused, materialize, targets, device=device, inference=inference, wrappers=wrappers)


def materialize_module(
    module: torch.nn.Module,
    buffers_only: bool = False,
    check_fn=None,
    *,
    device=None,
    inference: bool = False,
    progress: bool | None = None,
) -> torch.nn.Module:
    """Materialize every deferred tensor ``module`` and its children hold.

    Parameters, buffers, and plain tensor attributes (``self.freqs = ...``),
    also inside the lists, tuples, dicts and sets they hold, and the tensors
    other objects the modules hold keep (a hook's map of offloaded weights;
    see :func:`deferinit.holdings.holdings`): nothing reachable from the
    module is left deferred.  Tensors computed from
    parameters with autograd keep eager's graph: ``backward()`` reaches the
    parameters.  All tensors are computed first (one replay, intermediates freed at their
    last use) and swapped in last: if anything fails, the module is left
    exactly as it was, still deferred.  ``check_fn(submodule)`` decides
    whether a submodule's own tensors are materialized (as in torchdistx and
    FSDP); ``buffers_only`` leaves parameters deferred.  Returns ``module``;
    a second call is a no-op.

    ``device=`` maps every recorded device to this one; ``inference=True``
    replays under ``torch.inference_mode()`` and gives inference tensors, as
    eager construction under it would (tensors recorded under an ambient
    ``inference_mode()`` are inference tensors anyway);
    ``progress=True`` (or ``DEFERINIT_PROGRESS=1``) shows the tensors and
    bytes done on stderr (a tqdm bar; a terminal, Jupyter or a log) and
    leaves a one-line summary.  Once the replays know where a generator's
    stream ended (its last draw replayed), the generator is left where eager
    construction would have left it, provided nothing drew from it since
    ``deferred_init`` (with ``device=``: the target device's generator).
    Threads may ask at once (this module, a submodule, one of its tensors,
    ``load_checkpoint``): one call materializes, the others wait for it and
    find done what it made real (:mod:`deferinit.exclusive`).

    Example::

        >>> _ = torch.manual_seed(0); eager = torch.nn.Transformer(d_model=64, nhead=4)
        >>> _ = torch.manual_seed(0); m = deferred_init(torch.nn.Transformer, d_model=64, nhead=4)
        >>> materialize_module(m) is m
        True
        >>> all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), m.state_dict().values()))
        True
    """
    locked(exclusive(), _materialize_module, module, buffers_only, check_fn, device, inference, progress)
    return module


def _materialize_module(module, buffers_only, check_fn, device, inference, progress) -> None:
    slots = _script_slots(module)
    # One pause for the walk and the replay: the walk makes a few objects per
    # tensor that live until the replay, and a collector let run in between
    # makes a full pass over the record (with the walk in it: 4x the walk's
    # own time on 25,000 nn.Linear).  An interrupted call leaves the thread as
    # it found it, collector included (deferinit.fake.guard).
    restoring(Entry(), _collector_paused, _targets_then_replay, module, buffers_only, check_fn, device, inference,
              progress)
    for script_module, name, tensor in slots:
        if not is_fake(tensor):
            # The Python object is real now; TorchScript's C++ slot still
            # holds the tensor that was swapped out of it.
            script_module._c.setattr(name, tensor)


def _targets_then_replay(module, buffers_only, check_fn, device, inference, progress) -> None:
    # The targets are what is still deferred once no other thread is
    # materializing: tensors another call made real meanwhile are done.
    targets, left, counted, wrappers, wrapped = _module_targets(module, buffers_only, check_fn)
    if targets:
        # The walk saw every parameter and buffer when no check_fn left modules out.
        sharding = sharding_of(module, wrappers) if check_fn is not None or wrapped else None
        materialize(targets, device=device, inference=inference, progress=progress, kept_deferred=left,
                    counted=counted, wrappers=wrappers, sharding=sharding)


def _script_slots(module) -> list:
    """``(script module, name, deferred tensor)`` for the parameters and buffers
    that TorchScript modules in ``module`` (``torch.jit.script``) hold in C++
    slots: swapping a real tensor into the Python object leaves the slot on
    the fake, so the slot is pointed at the object again afterwards."""
    found = []
    for _, sub in module.named_modules(remove_duplicate=False):
        if isinstance(sub, torch.jit.ScriptModule):
            for name, t in (*sub._parameters.items(), *sub._buffers.items()):
                if t is not None and is_deferred_fake(t):
                    found.append((sub, name, t))
    return found


def _collector_paused(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with Python's cyclic garbage collector paused.

    A replay makes a few objects per recorded node that live until it ends,
    so in a record of many small tensors the collector runs full passes over
    every object of the process, the whole record included, again and again
    (40% of materializing 50,000 small parameters).  The record holds no
    reference cycles and a replay makes none, so the pause collects nothing
    later that it would have collected now; it is lifted when the replay ends,
    and left alone if something else paused the collector.  (A function, not
    a generator-based context manager: an interrupted generator is closed by
    the collector at some later time; the callers' Entry puts the collector
    back if an interrupt lands between the pause and the ``try``.)
    """
    if not gc.isenabled():
        return fn(*args, **kwargs)
    gc.disable()
    try:
        return fn(*args, **kwargs)
    finally:
        gc.enable()


def _module_targets(module, buffers_only, check_fn):
    """``(name, fake)`` for every deferred tensor the module holds (ties once;
    a wrapper subclass's deferred inner tensors, named by their path);
    ``{id(fake): name}`` of the parameters ``buffers_only`` leaves; the fakes
    progress counts: all but those other objects keep on the memory of a
    tensor the module holds (FSDP2's padded shards: aliases, not more work);
    the wrapper subclasses to rebuild, innermost first; whether a parameter or
    buffer of the modules walked is a wrapper subclass (see
    :func:`~deferinit.materialize.sharded.sharding_of`)."""
    targets, left, wrappers = [], {}, []
    seen, seen_wrappers = set(), set()
    beyond = set()
    walked: set = set()  # objects beyond the modules, walked once for the tree
    held = [
        (sub, holdings(sub, prefix, walked)) for prefix, sub in module.named_modules(remove_duplicate=False)
        if check_fn is None or check_fn(sub)
    ]
    # The modules' own tensors first (each module's parameters first: see
    # Holdings), then what other objects keep (which may be the same tensors:
    # FSDP2's state keeps the parameters it shards).
    lists = [h.tensors for _, h in held]
    lists += [[(name, t, "beyond") for name, t in h.beyond] for _, h in held]
    wrapped = False
    for tensors in lists:
        for name, t, kind in tensors:
            if (not buffers_only and isinstance(t, FakeTensor) and t._record is not None
                    and id(t) not in seen):  # the common case at once: a deferred fake, no wrapper
                seen.add(id(t))
                targets.append((name, t))
                if kind == "beyond":
                    beyond.add(id(t))
                continue
            if not wrapped and kind in ("parameter", "buffer") and is_wrapper(t):
                wrapped = True
            fakes = deferred_fakes_of(t, name)
            if not fakes:
                continue
            if buffers_only and (kind == "parameter" or t.__dict__.get("_is_param")):
                for label, fake in fakes:
                    left.setdefault(id(fake), label)
                continue
            for label, fake in fakes:
                if id(fake) not in seen:
                    seen.add(id(fake))
                    targets.append((label, fake))
                    if kind == "beyond":
                        beyond.add(id(fake))
            for w in _wrappers_of(t, name):
                if id(w) not in seen_wrappers:
                    seen_wrappers.add(id(w))
                    wrappers.append(w)
    if beyond:
        own = {id(f._storage) for _, f in targets if id(f) not in beyond}
        counted = [f for _, f in targets if id(f) not in beyond or id(f._storage) not in own]
    else:
        counted = [f for _, f in targets]
    return targets, left, counted, wrappers, wrapped


def _wrappers_of(t, name: str) -> list:
    """The wrapper subclasses ``t`` is made of, innermost first (see
    :func:`deferinit.wrappers.wrapper_layers`); refused when one was computed
    with autograd: rebuilt around its inner tensors it would be a leaf."""
    layers = wrapper_layers(t)
    for w in layers:
        if w.grad_fn is not None:
            raise AutogradMaterializationError(
                f"{name} is a {type(w).__name__} computed with autograd ({type(w.grad_fn).__name__}) "
                "from tensors that require grad; materialization rebuilds a wrapper subclass around "
                "its inner tensors, which would lose that graph. Compute it after materializing, "
                "or under torch.no_grad(). Nothing was changed."
            )
    return layers
