"""One materialization: plan -> replay -> dress -> swap -> hand over, all or nothing.

Every way in (:func:`~deferinit.materialize.materialize_tensor`,
:func:`~deferinit.materialize.materialize_module`, sharded modules
included) runs :func:`materialize`, one sequence of steps:

1. **plan**: the targets, plus the autograd leaves of those computed from
   parameters with autograd (their graph is replayed on the leaf objects,
   :class:`~deferinit.materialize.autograd.Binder`); cut into groups by a
   sharding step when one is given and no graph must be rebuilt
   (:class:`~deferinit.materialize.sharded.Sharding`: one storage or wrapper
   at a time), else one group;
2. **replay** each group (:class:`~deferinit.materialize.replay.Replay`),
   each value freed at its last use, progress counted when asked; the
   sharding step may then copy a group out of a storage much bigger than it
   spans;
3. **dress** each real tensor as its fake was (class, ``requires_grad``,
   the autograd graph checked against eager's);
4. **swap** them into the fake objects, wrappers rebuilt around them, the
   recorded storages told their real memory (:class:`~deferinit.materialize.swap.Swaps`);
5. **hand over** the generators (:mod:`deferinit.materialize.generators`).

Where a group's plan is only its targets' own factory calls (a model of
random parameters and constant buffers made real whole), steps 2 to 4 run
per tensor: each plain tensor is dressed and swapped in as the replay makes
it (:func:`_streamed`), one pass instead of three over many small tensors.
Either way, a failure, or an interrupt at any line before the commit,
leaves every tensor deferred and every generator as it was: the swaps made
are undone.
"""

from __future__ import annotations

import torch

from deferinit.fake.bypass import plain_queries
from deferinit.ir.plan import read_of

from .errors import AutogradMaterializationError
from .autograd import (
    Binder, deferred_leaves, fresh_reads, grad_fn_of, leaf_token, needs_graph, real_root_of, same_memory, view_again,
    with_fresh_graphs,
)
from .generators import committed_then_handed_over, records_of
from .graphcheck import check_graph
from .progress import start_progress
from .replay import Replay
from .swap import Swaps, dress, dress_fresh, dress_leaf


# A fake's C methods and properties, unbound: looked up on the instance, a
# subclass's, they cost as much again (asked of every tensor of a model).
_is_view = torch._C.TensorBase._is_view
_is_inference = torch._C.TensorBase.is_inference
_grad_fn = torch._C.TensorBase.grad_fn.__get__


def _plain_leaf(fake, real) -> bool:
    """A fake that is a leaf (no view, no graph, not inference) made real as a
    plain tensor that is no view: the common case, dressed at once."""
    return (type(real) is torch.Tensor and not _is_view(real) and not _is_view(fake) and _grad_fn(fake) is None
            and not _is_inference(fake))


# The kinds of node whose replay makes a new tensor object (see Replay.constant, Replay.call).
_FRESH = frozenset({"op", "constant"})


def materialize(targets, *, device=None, inference: bool = False, progress=False, counted=None,
                kept_deferred=None, wrappers=(), sharding=None) -> None:
    """Make ``targets`` (``(name, fake)`` pairs) real, in place, all or nothing.

    ``counted``: the fakes progress counts (default: the targets and their
    autograd leaves); ``kept_deferred``: ``{id(fake): name}`` of parameters
    left deferred, refused as autograd leaves; ``wrappers``: the wrapper
    subclasses to rebuild around the real inner tensors, innermost first;
    ``sharding``: a step that cuts the targets into groups replayed one at a
    time (see :class:`~deferinit.materialize.sharded.Sharding`).

    Example::

        >>> m = deferred_init(torch.nn.Linear, 2, 2)
        >>> materialize([("weight", m.weight), ("bias", m.bias)])
        >>> is_deferred(m.weight), is_deferred(m.bias)
        (False, False)
    """
    committed_then_handed_over(
        lambda hand: _run(hand, targets, device, inference, progress, counted, kept_deferred, wrappers, sharding),
        device,
    )


def _run(hand, targets, device, inference, progress, counted, kept_deferred, wrappers, sharding) -> None:
    """The steps (see :class:`~deferinit.materialize.generators.HandOver`); the
    fakes swapped out die with this frame."""
    # -- plan
    # A fake that is no view and has no grad_fn needs neither (most of them: asked first).
    with plain_queries():  # fakes
        graphs = any(
            (_is_view(fake) or grad_fn_of(fake) is not None) and (needs_graph(fake) or real_root_of(fake))
            for _, fake in targets
        )
    binder = None
    if graphs and not inference:
        targets, binder = _with_leaves(targets, kept_deferred)
    if counted is None:
        counted = [fake for _, fake in targets]
    # A group at a time needs no graph across groups: with graphs, one group.
    units = sharding.groups(targets) if sharding is not None and not graphs else [targets]

    shown = start_progress(progress, counted)
    counted = {id(f) for f in counted} if shown is not None else None
    try:
        fakes = [fake for group in units for _, fake in group]
        records = records_of(fakes)
        swaps = Swaps(wrappers=wrappers)
        # Plain tensors of a plan of factory calls are swapped in as the replay
        # makes them (see _streamed): undone with the rest if the call fails.
        streamed = binder is None and sharding is None and not inference and not torch.is_inference_mode_enabled()
        if streamed:
            hand.undone_by(swaps.undo)
        # -- replay
        streams: dict = {}  # the latest replay stream of each record stream
        computed = []  # (group, reads, reals, retaken, compacted)
        for group in units:
            computed.append(_replayed(group, device, inference, binder, shown, counted, streams, sharding,
                                      swaps if streamed else None))
        # -- dress, swap, hand over
        _swap_in(hand, computed, inference, binder, swaps, list(streams.values()), records)
    except BaseException:
        if shown is not None:
            shown.close(ok=False)
        raise
    if shown is not None:
        shown.close()


def _with_leaves(targets, kept_deferred):
    """The targets plus the deferred leaves of their autograd graphs (replayed
    on those leaf objects, materialized with them), and the binder that hands
    the leaf objects out."""
    extra = deferred_leaves(targets)
    for label, leaf in extra:
        if kept_deferred and id(leaf) in kept_deferred:
            raise AutogradMaterializationError(
                f"{label.replace(' (its autograd leaf)', '')} was computed with autograd from "
                f"parameter {kept_deferred[id(leaf)]}, which buffers_only=True leaves deferred; "
                "materialize them together (buffers_only=False). Nothing was changed."
            )
    targets = list(targets) + extra
    return targets, Binder(targets, lambda fake, t: dress(fake, t, False))


def _replayed(group, device, inference, binder, shown, counted, streams, sharding, swaps=None) -> tuple:
    """``(group, reads, reals, retaken, compacted)``: one group replayed; its
    replay streams merged into ``streams`` (a later group's stream of a record
    stream continues the earlier's); with ``swaps``, the plain tensors of a
    plan of factory calls swapped in as they are made (their reals: None)."""
    reads = [read_of(fake) for _, fake in group]
    labels = [name for name, _ in group]
    fresh = fresh_reads(group, reads) if binder is not None else []
    replay = Replay(reads + [r for _, r in fresh], device=device, inference=inference,
                    labels=labels + [labels[i] for i, _ in fresh], autograd=binder)
    if shown is not None:
        replay.progress = shown.replay_callback(replay, [f if id(f) in counted else None for _, f in group])
    sink = _streamed(group, reads, swaps) if swaps is not None else None
    reals = with_fresh_graphs(replay.run(sink), fresh, len(reads))
    if shown is not None:
        shown.draws_done(replay.draw_stats)
    for rs in replay.plan.replay_streams:
        earlier = streams.get(id(rs.post))
        if earlier is not None:
            rs.planned |= earlier.planned
        streams[id(rs.post)] = rs
    retaken = replay.retaken
    # What only the replay kept alive goes with it (the binder holds the fakes).
    replay.autograd = None
    del replay
    compacted = False
    if sharding is not None and binder is None:
        reals, compacted = sharding.compact(group, reals)
    return group, reads, reals, retaken, compacted


def _streamed(group, reads, swaps):
    """The replay's sink for ``group`` (see :meth:`Replay.run`): a plain leaf (no
    view, no graph, not inference, no storage shared or remembered by
    autograd) is dressed and swapped in once real, in the replay's loop; the
    others are left to :func:`_swap_in`.  The fakes are asked inside the
    replay's ``no_python_dispatch`` (no torch function: plain queries)."""
    def sink(i, real) -> bool:
        fake = group[i][1]
        d = fake.__dict__
        storage = d["_storage"]
        if storage.shared or d.get("_leaf") is not None or not _plain_leaf(fake, real):
            return False
        read = reads[i]
        # A replay's own op or constant makes a new object; an outside tensor
        # (``t.data = outside``) is the user's own object: a new one on its memory.
        dressed = dress_fresh(fake, real) if read.value.node.kind in _FRESH else dress_leaf(fake, real)
        swaps.one(fake, dressed, (read, storage))
        return True
    return sink


def _swap_in(hand, computed, inference, binder, swaps, streams, records) -> None:
    """Dress every result not swapped in yet, swap them in, rebuild the wrappers
    around them and remember the real storages, all or nothing (see
    :class:`~deferinit.materialize.generators.HandOver`)."""
    pairs, names, remember = [], [], []
    for group, reads, reals, retaken, compacted in computed:
        if all(real is None for real in reals):  # all swapped in by the replay (_streamed)
            continue
        # Each storage learns its real memory with its tensor's swap, unless
        # compacted (nothing else can read that storage: see Sharding.compact).
        for (name, fake), read, pair in zip(group, reads, _dressed(group, reals, inference, binder, retaken)):
            if pair is None:  # swapped in by the replay (_streamed)
                continue
            storage = fake._storage
            if storage.shared:  # share_memory_() while deferred (model.share_memory())
                pair[1].share_memory_()
            pairs.append(pair)
            names.append(name)
            remember.append(None if compacted else (read, storage))
    _one_object_each(pairs, names)
    tokens = [(fake, leaf_token(fake)) for fake, _ in pairs]
    kept = [(token, token.real, token.real_version) for _, token in tokens if token is not None]

    def undo():
        for token, real, version in kept:
            token.real, token.real_version = real, version
        swaps.undo()

    hand.undone_by(undo)  # run by the hand-over's exit unless committed, whatever interrupts
    try:
        swaps.run(remember, pairs)
        for fake, token in tokens if kept else ():
            if token is not None:
                token.real = fake  # now real: graphs replayed later reach it
                token.real_version = None if fake.is_inference() else fake._version
        hand.streams, hand.records = streams, records
        hand.committed = True
    except BaseException:
        if not hand.committed:
            undo()
        raise


def _dressed(group, reals, inference, binder, retaken=()) -> list:
    """``(fake, real object to swap in)`` pairs; autograd graphs checked first."""
    # Most tensors are plain leaves made real as plain tensors (not views, no
    # graph, not inference): nothing to check, dressed at once.
    pairs = [None] * len(group)
    others = []
    if binder is None and not inference and not torch.is_inference_mode_enabled():
        with plain_queries():  # fakes, and tensors the replay made
            for i, ((_, fake), real) in enumerate(zip(group, reals)):
                if real is None:  # swapped in already (_streamed)
                    continue
                if _plain_leaf(fake, real):
                    pairs[i] = (fake, dress_leaf(fake, real))
                else:
                    others.append(i)
    else:
        others = range(len(group))
    for i in others:
        (name, fake), real = group[i], reals[i]
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
        pairs[i] = (fake, dress(fake, real, inference, made, i in retaken))
    return pairs


def _one_object_each(pairs, names) -> None:
    """Refuse two fakes that came out of the replay as one object."""
    if len({id(obj) for _, obj in pairs}) == len(pairs):
        return
    seen = {}
    for (_, obj), name in zip(pairs, names):
        other = seen.setdefault(id(obj), name)
        if other is not name:
            raise AutogradMaterializationError(
                f"{other} and {name} are two tensor objects eagerly but came out of the replay as "
                "one (two names for one value computed with autograd). Nothing was changed."
            )
