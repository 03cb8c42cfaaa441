"""``materialize_tensor`` and ``materialize_module``."""

from __future__ import annotations

import contextlib
import gc
import warnings

import torch

from deferinit.errors import AutogradMaterializationError
from deferinit.exclusive import exclusive
from deferinit.fake.guard import Entry
from deferinit.holdings import holdings
from deferinit.plan import read_of
from deferinit.recorder import is_deferred_fake

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


def _fake_of(t):
    """The deferred fake behind ``t`` (itself, or a DTensor's local shard), or None."""
    if is_deferred_fake(t):
        return t
    local = getattr(t, "_local_tensor", None)
    return local if is_deferred_fake(local) else None


def materialize_tensor(tensor: torch.Tensor, *, device=None, inference: bool = False) -> torch.Tensor:
    """Make a deferred tensor real, in place, and return it.

    The tensor object itself becomes real (``torch.utils.swap_tensors``):
    every reference to it (module attributes, an optimizer, a tied module)
    now sees real memory with exactly the values eager construction would
    have produced.  A real or plain fake tensor is returned as it is, and a
    second call is a no-op (also one that waited for another thread's
    materialization of the same tensor).  ``device=`` materializes on another device than
    the recorded one; ``inference=True`` gives inference tensors.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 4, 4)
        >>> w = m.weight
        >>> materialize_tensor(w) is w, is_deferred(w)
        (True, False)
    """
    with exclusive():  # another thread may be materializing it: decided once it is done
        fake = _fake_of(tensor)
        if fake is None:
            return tensor
        entry = Entry()  # an interrupted call leaves the thread as it found it (deferinit.fake.guard)
        try:
            with _collector_paused():
                _materialize([("tensor", fake)], device=device, inference=inference, progress=False)
        except BaseException:
            entry.restore()
            raise
    return tensor


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
    also inside the lists, tuples, dicts and sets they hold (see
    :func:`deferinit.holdings.holdings`); deferred tensors that other objects
    hold are left, with a warning naming them.  Tensors computed from
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
    with exclusive():
        # The targets are what is still deferred once no other thread is
        # materializing: tensors another call made real meanwhile are done.
        targets, left, beyond = _module_targets(module, buffers_only, check_fn)
        if targets:
            entry = Entry()  # an interrupted call leaves the thread as it found it (deferinit.fake.guard)
            try:
                with _collector_paused():
                    if not materialize_sharded(module, targets, device=device, inference=inference, progress=progress):
                        _materialize(targets, device=device, inference=inference, progress=progress, kept_deferred=left)
            except BaseException:
                entry.restore()
                raise
    if beyond:
        names = ", ".join(beyond[:5]) + (f" and {len(beyond) - 5} more" if len(beyond) > 5 else "")
        warnings.warn(
            f"materialize_module left deferred {len(beyond)} tensor(s) that objects other than "
            f"modules and plain containers hold: {names}. Make them buffers or plain attributes, "
            "or materialize them with materialize_tensor.",
            stacklevel=2,
        )
    return module


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused for the duration of a replay.

    A replay makes a few objects per recorded node that live until it ends,
    so in a record of many small tensors the collector runs full passes over
    every object of the process, the whole record included, again and again
    (40% of materializing 50,000 small parameters).  The record holds no
    reference cycles and a replay makes none, so the pause collects nothing
    later that it would have collected now; it is lifted when the replay ends,
    and left alone if something else paused the collector.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _module_targets(module, buffers_only, check_fn):
    """``(name, fake)`` for every deferred tensor the module holds (ties once);
    ``{id(fake): name}`` of the parameters ``buffers_only`` leaves; the names
    of deferred tensors held beyond the walk (other objects' attributes)."""
    targets, left, beyond = [], {}, []
    seen = set()
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if check_fn is not None and not check_fn(sub):
            continue
        held = holdings(sub, prefix)
        ordered = [x for x in held.tensors if x[2] == "parameter"] + [x for x in held.tensors if x[2] != "parameter"]
        for name, t, kind in ordered:
            fake = _fake_of(t)
            if fake is None or id(fake) in seen:
                continue
            if buffers_only and (kind == "parameter" or fake.__dict__.get("_is_param")):
                left.setdefault(id(fake), name)
                continue
            seen.add(id(fake))
            targets.append((name, fake))
        for name, t in held.beyond:
            fake = _fake_of(t)
            if fake is not None and id(fake) not in seen:
                beyond.append(name)
    return targets, left, beyond


def _materialize(targets, *, device, inference, progress, kept_deferred=None) -> None:
    committed_then_handed_over(
        lambda hand: _swap_in(hand, targets, device=device, inference=inference, progress=progress,
                              kept_deferred=kept_deferred),
        device,
    )


def _swap_in(hand, targets, *, device, inference, progress, kept_deferred) -> None:
    """Compute ``targets`` and swap them in, all or nothing (see
    :class:`~deferinit.materialize.generators.HandOver`); the fakes swapped out
    die with this frame."""
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
    shown = start_progress(progress, fakes)
    try:
        replay = Replay(reads + [r for _, r in fresh], device=device, inference=inference,
                        labels=labels + [labels[i] for i, _ in fresh], autograd=binder)
        if shown is not None:
            replay.progress = shown.replay_callback(replay, fakes)
        reals = with_fresh_graphs(replay.run(), fresh, len(reads))
        if shown is not None:
            shown.draws_done(replay.draw_stats)
        records = records_of(fakes)
        storages = [fake._storage for fake in fakes]
        tokens = [leaf_token(fake) for fake in fakes]
        pairs = _dressed(targets, reals, inference, binder, replay.retaken)
        swaps = Swaps(pairs)
        kept = [(token, token.real, token.real_version) for token in tokens if token is not None]
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
                for token, real, version in kept:
                    token.real, token.real_version = real, version
                swaps.undo()
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
