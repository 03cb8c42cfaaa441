"""Leaving the generators where eager construction would have left them.

Once a materialization knows the state a stream ended in, its generator is
moved there, provided nothing moved it since deferral: it still holds the
state recording (or the record it continues) left, and no seed or state was
set since (:class:`deferinit.random.record.Lineage`).  A stream's end is
known when its last draw was replayed, or when every draw after it is dead
(a temporary, a draw later writes overwrote) or read for its geometry only:
those are replayed into scratch memory.  Draws into tensors still deferred,
or that a checkpoint load overwrote, make the generator wait.  With
``device=``, the target device's generator is the one moved.
"""

from __future__ import annotations

import sys
import traceback

from deferinit.errors import MaterializationError
from deferinit.ir.liveness import hidden_by_load
from deferinit.ir.plan import DeviceMap
from deferinit.random.record import FOREIGN, LINEAGE
from deferinit.random.rng import generator_of, get_state, initialized_generators, same_state
from deferinit.random.seeding import release_if_moot
from deferinit.random.streams import replay_streams, state_before

from .replay import Replay


class HandOver:
    """One materialization's commit and generator hand-over, all or nothing.

    The work (compute, then swap in) registers how to undo its swaps
    (:meth:`undone_by`) before it makes them, fills ``streams`` and
    ``records`` and sets ``committed`` last.  :meth:`finish` decides once the
    work has ended, however it ended: not committed, the swaps are undone and
    the default generators put back in the states they had (a replay borrows
    them for operators without a ``generator`` argument); committed, the
    hand-over runs to its end even if an interrupt arrives in it: the module
    is then entirely done, generators included.  Both are idempotent, so a
    second interrupt inside the first finish leaves the second to finish.
    """

    def __init__(self):
        self.saved = [(gen, get_state(gen)) for _, gen in initialized_generators()]
        self.committed = False
        self.worked = False  # the work returned
        self.done = False
        self.undos: list = []
        self.streams: list = []
        self.records: list = []
        # The exception being handled when the call began (its frames are not ours to clear).
        self.outer = sys.exc_info()[1]

    def undone_by(self, undo) -> None:
        """Have ``undo()`` (idempotent) run if the work ends without committing."""
        self.undos.append(undo)

    def restore(self) -> None:
        for gen, state in self.saved:
            if not same_state(get_state(gen), state):
                FOREIGN.set_state(gen, state)

    def finish(self, device) -> None:
        """Undo or hand over, as the work ended (idempotent; see the class)."""
        if self.done:
            return
        if self.committed or self.worked:
            if not self.worked:
                # Interrupted after the commit: the swapped-out fakes held by the
                # finished frames go first, as on the ordinary path (see pipeline._run).
                self._clear_finished_frames()
            hand_over_generators(self.streams, device, self.records)
        else:
            for undo in reversed(self.undos):
                undo()
            self.restore()
        self.done = True

    def _clear_finished_frames(self) -> None:
        e, seen = sys.exc_info()[1], set()
        while e is not None and e is not self.outer and id(e) not in seen:
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)  # frames still running are left alone
            e = e.__context__


def committed_then_handed_over(work, device) -> None:
    """Run ``work(hand)`` (see :class:`HandOver`), then hand the generators over.

    Three exits, each on one line (see :mod:`deferinit.fake.guard`): wherever
    two interrupts arrive (the first in the work or in the first exit, the
    second in the next), a later exit finishes.

    Example::

        >>> def work(hand):
        ...     hand.committed = True     # nothing to swap: a hand-over of no streams
        >>> committed_then_handed_over(work, None)
    """
    hand = HandOver()
    try: work(hand); hand.worked = True  # noqa: E701,E702 - one line each: see deferinit.fake.guard
    finally:
        try: hand.finish(device)  # noqa: E701
        finally:
            try: hand.finish(device)  # noqa: E701
            finally: hand.finish(device)  # noqa: E701


def records_of(fakes) -> list:
    """The records of ``fakes``, taken before the swap (which may free them)."""
    return list({id(r): r for f in fakes if (r := f._record) is not None}.values())


def hand_over_generators(streams, device=None, records=()) -> None:
    """After a successful materialization: advance each generator whose final state
    the replay now knows, if nothing drew from it or set it since deferral.

    ``streams`` are the replay's; the streams of ``records`` (those of the
    tensors materialized) that the replay did not need are considered too:
    a record whose draws all went into temporaries still ends somewhere.

    Example::

        >>> _ = torch.manual_seed(0); eager = torch.nn.Linear(2, 2); after = torch.rand(3)
        >>> _ = torch.manual_seed(0); m = deferred_init(torch.nn.Linear, 2, 2)
        >>> _ = materialize_module(m)   # calls hand_over_generators
        >>> torch.equal(torch.rand(3), after)
        True
    """
    streams = list(streams)
    planned = {id(s) for rs in streams for s in rs.sources}
    unplanned = [s for r in records for s in r.streams.values() if id(s) not in planned]
    if unplanned:
        streams += list({id(rs): rs for rs in replay_streams(unplanned, DeviceMap(device)).values()}.values())
    for rs in _in_order(streams):
        end = state_before(rs, len(rs.nodes))
        if end is None:
            end = _finish(rs, device)
        if end is None:
            continue
        gen = generator_of(rs.key)
        if gen is None:
            continue
        left = list(rs.left)
        if rs.after is not None:
            start = state_before(rs, 0)
            if start is not None:
                left.append(start)
        now = get_state(gen)
        if any(same_state(now, state) for state in left) and _not_reseeded(rs):
            FOREIGN.set_state(gen, end)  # not a threads' recording's own reseed
    for record in {id(r): r for r in (*records, *_records_of(streams))}.values():
        release_if_moot(record)


def _records_of(streams):
    for rs in streams:
        for s in rs.sources:
            record = s.record() if s.record is not None else None
            if record is not None:
                yield record


def _not_reseeded(rs) -> bool:
    """Whether the generator's eager state still follows from the states the
    records of ``rs`` left it in: no seed or state was set since (even one
    equal to the state it holds; see :class:`deferinit.random.record.Lineage`)."""
    return all(LINEAGE.descends(rs.key, record.lineage.get(rs.key)) for record in _records_of([rs]))


def _finish(rs, device):
    """The end state of ``rs`` after replaying its trailing temporaries, or None
    when a draw after the last known state is not a temporary."""
    k = len(rs.nodes)
    while k > 0 and state_before(rs, k) is None:
        k -= 1
    tail = rs.nodes[k:]
    if not tail or not all(_dead(n) or _depended_on(rs, k + i, n) for i, n in enumerate(tail)):
        return None
    try:
        Replay([], device=device, extra=tail, labels=["random temporaries"]).run()
    except MaterializationError:
        return None  # the tensors are real and right; the generator just waits
    return state_before(rs, len(rs.nodes))


def _dead(node) -> bool:
    """Whether ``node`` drew values nothing will read: a temporary, or a draw into
    a tensor already materialized whose values later writes overwrote (replay
    skipped it), but not one a checkpoint load overwrote (that is the
    initialization the load replaces: the generator waits instead)."""
    if node.rng_target is None or hidden_by_load(node):
        return False
    storage = node.rng_target()
    return storage is None or storage.real is not None


def _depended_on(rs, index: int, node) -> bool:
    """Whether the replay's reads depended on draw ``index`` although it did not
    run: a tensor read only for its geometry (``new_zeros`` of a deferred
    tensor, as DTensor makes a rank's empty piece) or allocated because later
    writes hide its values.  Eager drew it all the same, and every rank of a
    sharded model depends on it alike: the generator must not wait for it
    (unless a checkpoint load hid it)."""
    return index in rs.planned and not hidden_by_load(node)


def _in_order(streams) -> list:
    """Streams an earlier record's before those continuing it."""
    return sorted(streams, key=lambda rs: rs.nodes[0].seq if rs.nodes else -1)
