"""``materialize_tensor`` and ``materialize_module``."""

from __future__ import annotations

import gc

import torch

from deferinit.errors import AutogradMaterializationError
from deferinit.exclusive import exclusive
from deferinit.fake.guard import Entry, restoring
from deferinit.fake.locking import locked
from deferinit.fake.tensor import is_fake
from deferinit.holdings import attached, holdings
from deferinit.plan import read_of
from deferinit.recorder import is_deferred_fake
from deferinit.wrappers import inner_tensors, wrapper_layers

from .autograd import (
    Binder, deferred_leaves, fresh_reads, leaf_token, needs_graph, real_root_of, same_memory, view_again,
    with_fresh_graphs,
)
from .graphcheck import check_graph

from .generators import committed_then_handed_over, records_of
from .progress import start_progress
from .replay import Replay
from .sharded import materialize_sharded
from .swap import Swaps, dress


def _fakes_of(t, name: str) -> list:
    """``(label, fake)`` for the deferred fakes behind ``t``: itself, or those
    inside a wrapper subclass (see :mod:`deferinit.wrappers`)."""
    if is_deferred_fake(t):
        return [(name, t)]
    return [(name + path, x) for path, x in inner_tensors(t) if is_deferred_fake(x)]


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
    targets = _fakes_of(tensor, "tensor")
    wrappers = _wrappers_of(tensor, "tensor")
    # What the tensor carries (bitsandbytes' SCB; see deferinit.holdings.attached).
    for name, t in attached(tensor):
        for label, fake in _fakes_of(t, name):
            if all(fake is not f for _, f in targets):
                targets.append((label, fake))
        wrappers += [w for w in _wrappers_of(t, name) if all(w is not x for x in wrappers)]
    if not targets:
        return
    # An interrupted call leaves the thread as it found it, collector included (deferinit.fake.guard).
    restoring(Entry(), _collector_paused, _materialize, targets, device=device, inference=inference,
              progress=False, wrappers=wrappers)


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
    # The targets are what is still deferred once no other thread is
    # materializing: tensors another call made real meanwhile are done.
    targets, left, counted, wrappers = _module_targets(module, buffers_only, check_fn)
    slots = _script_slots(module)
    if targets:
        # An interrupted call leaves the thread as it found it, collector included (deferinit.fake.guard).
        restoring(Entry(), _collector_paused, _replay_module, module, targets, left, counted, wrappers, device,
                  inference, progress)
    for script_module, name, tensor in slots:
        if not is_fake(tensor):
            # The Python object is real now; TorchScript's C++ slot still
            # holds the tensor that was swapped out of it.
            script_module._c.setattr(name, tensor)


def _replay_module(module, targets, left, counted, wrappers, device, inference, progress) -> None:
    if not materialize_sharded(module, targets, device=device, inference=inference, progress=progress,
                               counted=counted, wrappers=wrappers):
        _materialize(targets, device=device, inference=inference, progress=progress,
                     kept_deferred=left, counted=counted, wrappers=wrappers)


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
    the collector at some later time; the callers' undo re-enables it if an
    interrupt lands between the pause and the ``try``.)
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
    the wrapper subclasses to rebuild, innermost first."""
    targets, left, wrappers = [], {}, []
    seen, seen_wrappers = set(), set()
    beyond = set()
    walked: set = set()  # objects beyond the modules, walked once for the tree
    held = [
        (sub, holdings(sub, prefix, walked)) for prefix, sub in module.named_modules(remove_duplicate=False)
        if check_fn is None or check_fn(sub)
    ]
    # The modules' own tensors first, then what other objects keep (which may
    # be the same tensors: FSDP2's state keeps the parameters it shards).
    lists = [[x for x in h.tensors if x[2] == "parameter"] + [x for x in h.tensors if x[2] != "parameter"]
             for _, h in held]
    lists += [[(name, t, "beyond") for name, t in h.beyond] for _, h in held]
    for tensors in lists:
        for name, t, kind in tensors:
            fakes = _fakes_of(t, name)
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
    own = {id(f._storage) for _, f in targets if id(f) not in beyond}
    counted = [f for _, f in targets if id(f) not in beyond or id(f._storage) not in own]
    return targets, left, counted, wrappers


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


def _materialize(targets, *, device, inference, progress, kept_deferred=None, counted=None, wrappers=()) -> None:
    committed_then_handed_over(
        lambda hand: _swap_in(hand, targets, device=device, inference=inference, progress=progress,
                              kept_deferred=kept_deferred, counted=counted, wrappers=wrappers),
        device,
    )


def _swap_in(hand, targets, *, device, inference, progress, kept_deferred, counted=None, wrappers=()) -> None:
    """Compute ``targets`` and swap them in, rebuilding ``wrappers`` around them, all
    or nothing (see :class:`~deferinit.materialize.generators.HandOver`); the
    fakes swapped out die with this frame."""
    binder = None
    if not inference and any(needs_graph(fake) or real_root_of(fake) for _, fake in targets):
        # Tensors computed from parameters with autograd: replay their graph
        # on the leaf objects, which are materialized with them.
        extra = deferred_leaves(targets)
        for label, leaf in extra:
            if kept_deferred and id(leaf) in kept_deferred:
                raise AutogradMaterializationError(
                    f"{label.replace(' (its autograd leaf)', '')} was computed with autograd from "
                    f"parameter {kept_deferred[id(leaf)]}, which buffers_only=True leaves deferred; "
                    "materialize them together (buffers_only=False). Nothing was changed."
                )
        targets = list(targets) + extra
        binder = Binder(targets, lambda fake, t: dress(fake, t, False))
    reads = [read_of(fake) for _, fake in targets]
    labels = [name for name, _ in targets]
    fakes = [fake for _, fake in targets]
    fresh = fresh_reads(targets, reads) if binder is not None else []
    if counted is None:
        counted = fakes
    shown = start_progress(progress, counted)
    counted = {id(f) for f in counted}
    try:
        replay = Replay(reads + [r for _, r in fresh], device=device, inference=inference,
                        labels=labels + [labels[i] for i, _ in fresh], autograd=binder)
        if shown is not None:
            replay.progress = shown.replay_callback(replay, [f if id(f) in counted else None for f in fakes])
        reals = with_fresh_graphs(replay.run(), fresh, len(reads))
        if shown is not None:
            shown.draws_done(replay.draw_stats)
        records = records_of(fakes)
        storages = [fake._storage for fake in fakes]
        tokens = [leaf_token(fake) for fake in fakes]
        pairs = _dressed(targets, reals, inference, binder, replay.retaken)
        for storage, (_, real) in zip(storages, pairs):
            if storage.shared:  # share_memory_() while deferred (model.share_memory())
                real.share_memory_()
        swaps = Swaps(pairs, wrappers)
        kept = [(token, token.real, token.real_version) for token in tokens if token is not None]

        def undo():
            for token, real, version in kept:
                token.real, token.real_version = real, version
            swaps.undo()

        hand.undone_by(undo)  # run by the hand-over's exit unless committed, whatever interrupts
        try:
            swaps.run()
            for fake, token in zip(fakes, tokens):
                if token is not None:
                    token.real = fake  # now real: graphs replayed later reach it
                    token.real_version = None if fake.is_inference() else fake._version
            # The fakes are the real tensors now (``reals`` may have been swapped out).
            swaps.remember(reads, storages, fakes)
            hand.streams, hand.records = replay.replay_streams, records
            hand.committed = True
        except BaseException:
            if not hand.committed:
                undo()
            raise
    except BaseException:
        if shown is not None:
            shown.close(ok=False)
        raise
    if shown is not None:
        shown.close()
    # The fakes swapped out die with this frame, and with them what only they
    # kept alive: draws into such tensors become temporaries of the record.
    replay.autograd = None


def _dressed(targets, reals, inference, binder, retaken=()) -> list:
    """``(fake, real object to swap in)`` pairs; autograd graphs checked first."""
    pairs = []
    for i, ((name, fake), real) in enumerate(zip(targets, reals)):
        made = binder.made_for(fake) if binder is not None else None
        if made is not None:
            if not same_memory(made, real):
                # The fake's data was replaced after autograd read it (.data =).
                with torch.no_grad():
                    made.data = real
            if made.requires_grad != fake.requires_grad:
                made.requires_grad_(fake.requires_grad)
        if not inference:
            real = view_again(real, fake)
            check_graph(name, fake, real, binder)
        pairs.append((fake, dress(fake, real, inference, made, i in retaken)))
    seen = {}
    for (fake, obj), (name, _) in zip(pairs, targets):
        other = seen.setdefault(id(obj), name)
        if other is not name:
            raise AutogradMaterializationError(
                f"{other} and {name} are two tensor objects eagerly but came out of the replay as "
                "one (two names for one value computed with autograd). Nothing was changed."
            )
    return pairs
