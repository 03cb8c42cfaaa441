"""Generator streams: the draws from one generator in order, what is known of its state between them, and the state at draw k.

What a stream knows, position by position (``k`` is "right before draw
``k``"; ``len(nodes)`` is the end):

* **events**, recorded while user code ran: the generator's real state when
  the stream started (``OBSERVED``), a state set (``SET``), ``manual_seed(s)``
  (``SEED``, resolved against whichever generator replays it), the state
  right after draw ``d`` put back (``SAME(d)``, e.g. by ``fork_rng``);
* **post** states: ``post[d]``, the exact state right after draw ``d``,
  cached by replay;
* **after**: the stream of an earlier record this one continues.

A record keeps a :class:`Stream` per generator; a replay sees each through a
:class:`ReplayStream`, which a device remap may *merge* from several (draws
recorded for ``cpu`` and ``cuda`` all come from the target device's
generator, in recorded order).  One walk (:func:`walk_back`) answers, for
both, the state at draw ``k`` (:func:`state_before`) and the draws to replay
to know it.
"""

from __future__ import annotations

import bisect
import weakref

import torch

from deferinit.fake.device import normalize

from ..errors import ReplayError
from ..ir.graph import event_seq
from .rng import OBSERVED, SAME, SEED, SET, generator_of, gettable, seed_of_state, seeded_state


class Stream:
    """The random nodes of one record that draw from one generator, in order,
    and what is known of the generator's states between them (see the module
    docstring)."""

    __slots__ = (
        "key", "nodes", "events", "post", "after", "record", "record_id", "ref", "generator",
        "observed", "since", "base", "merged", "__weakref__",
    )

    def __init__(self, key, record=None):
        self.key = key
        # Weak: the record owns its streams.
        self.record = weakref.ref(record) if record is not None else None
        self.record_id = record.id if record is not None else None
        self.ref = weakref.ref(self)  # shared by the stream's nodes
        self.generator = generator_of(key) if gettable(key) else None
        self.nodes: list = []
        # position k -> (seq, kind, value): what user code did right before draw k.
        self.events: dict[int, tuple] = {}
        # draw d -> the exact state right after it (learned by replay).
        self.post: dict[int, torch.Tensor] = {}
        self.after: Stream | None = None
        # The seed last seen while recording (tells seeds set by C++ calls
        # between draws), and deferinit.random.record.FOREIGN's epoch then.
        self.observed = None
        self.since = 0
        # For explicit generators, the real state to give back when recording
        # stops (they are marked, see Record.add_random).
        self.base = None
        # Post states of replays merging this stream with others (a device
        # remap), by (target, streams merged); kept by the group's first stream.
        self.merged: dict = {}

    @property
    def device(self) -> torch.device:
        return self.key if type(self.key) is torch.device else normalize(self.key.generator.device)

    def event(self, k: int, kind: str, value) -> None:
        """User code set the generator right before draw ``k``."""
        self.events[k] = (event_seq(), kind, value)

    def __repr__(self) -> str:
        return f"<Stream {self.key} {len(self.nodes)} draws>"


class ReplayStream:
    """The draws one generator makes in a replay, in order.

    ``events[k]``, ``post[d]`` and ``after`` as in :class:`Stream`
    (``post`` is shared with the record, so what a replay learns serves the
    next; ``after`` is the replay stream of the record this one continues);
    ``left`` lists the states the real generator may still be in when nothing
    drew from it since deferral (see :mod:`deferinit.materialize.generators`);
    ``planned`` the positions of the draws the replay's reads depend on, if
    only for their geometry (the plan fills it).
    """

    __slots__ = ("key", "device", "nodes", "index", "events", "post", "after", "left", "generator", "sources", "planned")

    def __init__(self, key, device, nodes, events, post, *, after=None, left=(), sources=()):
        self.key = key
        self.device = device
        self.nodes = nodes
        self.index = {id(n): i for i, n in enumerate(nodes)}
        self.events = events
        self.post = post
        self.after = after
        self.left = list(left)
        self.generator = None  # the private generator replay draws from
        # The record streams replayed (kept alive: their nodes point back to
        # them weakly, and a replay after the record died still needs them).
        self.sources = list(sources)
        self.planned: set[int] = set()

    def needs_all(self, ks) -> list:
        """The draws to replay so that the states right before every draw in ``ks``
        are known, each once: walks from a position already walked stop there,
        so the cost is the number of draws walked, not ``len(ks)`` times it."""
        draws: list = []
        seen: set = set()
        for k in sorted(set(ks), reverse=True):
            walk_back(self, k, draws, seen)
        return draws

    def learn(self, d: int, state: torch.Tensor) -> None:
        """Cache the exact state right after draw ``d``."""
        self.post.setdefault(d, state)

    def __repr__(self) -> str:
        return f"<ReplayStream {self.key} {len(self.nodes)} draws>"


# -- the state at draw k: one walk, for record and replay streams alike -------------

POST = "post"  # a fact that is no event: the exact state after a draw, learned by replay


def walk_back(stream, k: int, draws: list | None = None, seen: set | None = None):
    """The nearest fact known of the state of ``stream``'s generator (a record's
    :class:`Stream` or a :class:`ReplayStream`) at or before position ``k``:
    ``(kind, value)`` of an event, ``(POST, state)``, or None at the start of
    the chain.  A draw not replayed yet may stand between: with a list
    ``draws``, the walk appends it (nearest first) and goes on; without, it
    stops there and returns None.  It also stops, returning None, at a
    position in ``seen``, which collects those passed.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 4, 3)    # two draws: weight, bias
        >>> draws = []; _ = walk_back(m.weight._record.streams[torch.device("cpu")], 2, draws)
        >>> len(draws)                                  # both stand before the end
        2
    """
    while True:
        if seen is not None:
            at = (id(stream), k)
            if at in seen:
                return None
            seen.add(at)
        event = stream.events.get(k)
        if event is not None:
            if event[1] != SAME:
                return event[1], event[2]
            k = event[2]
            if k in stream.post:
                return POST, stream.post[k]
        elif k == 0:
            if stream.after is None:
                return None
            stream, k = stream.after, len(stream.after.nodes)
            continue
        else:
            k -= 1
            if k in stream.post:
                return POST, stream.post[k]
        if draws is None:
            return None
        draws.append(stream.nodes[k])


def continues(stream, k: int) -> bool:
    """Whether nothing but draw ``k - 1`` tells the state right before draw ``k``
    (no event there, no state cached after ``k - 1``, not the start):
    :func:`walk_back`'s first step, asked alone on the replay's hot path.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 4, 3)    # two draws: weight, bias
        >>> stream = m.weight._record.streams[torch.device("cpu")]
        >>> continues(stream, 0), continues(stream, 1)
        (False, True)
    """
    return k != 0 and k not in stream.events and k - 1 not in stream.post


def state_before(stream, k: int) -> torch.Tensor | None:
    """The exact state of ``stream``'s generator right before its draw ``k``, as far as
    it is known without replaying (None: a draw not replayed yet stands between,
    or the stream starts where its generator could not be read).  Every
    question "the state at draw k" ends here; while recording,
    ``RECORDER.generator_state`` (:func:`deferinit.materialize.evaluate.generator_state`)
    first replays the draws :func:`walk_back` names.

    Example::

        >>> _ = torch.manual_seed(5); m = deferred_init(torch.nn.Linear, 4, 3)
        >>> stream = m.weight._record.streams[torch.device("cpu")]
        >>> torch.equal(state_before(stream, 0), torch.manual_seed(5).get_state())
        True
        >>> state_before(stream, 1) is None                # the weight's draw not replayed
        True
    """
    fact = walk_back(stream, k)
    if fact is None:
        return None
    kind, value = fact
    if kind == SEED:
        return seeded_state(stream.device, value)
    if kind == "foreign":
        raise ReplayError(
            f"the record sets the state of the {value} generator explicitly "
            f"(set_rng_state / set_state), and that state cannot be given to "
            f"{stream.device}'s generator. Materialize on {value.type}, or seed with "
            "manual_seed instead of setting states."
        )
    return value


def seed_before(stream, k: int) -> int:
    """The ``initial_seed()`` of ``stream``'s generator right before draw ``k``: draws
    do not change it, so the nearest fact answers, however many draws stand between.

    Example::

        >>> _ = torch.manual_seed(7); m = deferred_init(torch.nn.Linear, 4, 3)
        >>> seed_before(m.weight._record.streams[torch.device("cpu")], 2)
        7
    """
    fact = walk_back(stream, k, [])
    if fact is None:
        return torch._C.Generator.initial_seed(generator_of(stream.key))
    kind, value = fact
    return value if kind == SEED else seed_of_state(stream.device, value)


def replay_streams(streams: list[Stream], device_map) -> dict:
    """``id(record stream) -> ReplayStream`` for ``streams`` and the streams they
    continue (a device remap may merge several into one)."""
    result: dict = {}
    made: dict = {}  # merged streams, each made once
    by_target: dict = {}
    for stream in streams:
        record = stream.record() if stream.record is not None else None
        target = device_map.stream_key(stream.key)
        group = by_target.setdefault((id(record), target), (record, target, []))[2]
        if all(stream is not s for s in group):
            group.append(stream)
    if device_map.target is not None:
        # Eager construction on the target device draws every one of the
        # record's device streams from its generator, in recorded order: a
        # draw of one stream needs the draws of the others made before it.
        for record, target, group in by_target.values():
            for key, stream in (record.streams.items() if record is not None else ()):
                if type(key) is torch.device and device_map.stream_key(key) == target:
                    if all(stream is not s for s in group):
                        group.append(stream)
    for record, target, group in by_target.values():
        if len(group) == 1 and group[0].key == target:
            _own(group[0], result)
        else:
            rs = _merged(record, target, group, made)
            for stream in group:
                result[id(stream)] = rs
    return result


def _own(stream: Stream, result: dict) -> ReplayStream:
    """The replay stream of ``stream`` drawing from its own generator (and of the
    streams it continues)."""
    rs = result.get(id(stream))
    if rs is not None:
        return rs
    after = _own(stream.after, result) if stream.after is not None else None
    record = stream.record() if stream.record is not None else None
    exit_state = record.exit.get(stream.key) if record is not None else None
    rs = ReplayStream(
        stream.key, stream.device, stream.nodes, stream.events, stream.post,
        after=after, left=[exit_state] if exit_state is not None else [], sources=[stream],
    )
    result[id(stream)] = rs
    return rs


def _merged(record, target, group: list[Stream], made: dict) -> ReplayStream:
    """Draws recorded for several generators, replayed from ``target``'s.  When
    every stream of the group continues a stream of one earlier record, the
    merged stream continues that record's merged stream."""
    cache_key = (target, frozenset(id(s) for s in group))
    if cache_key in made:
        return made[cache_key]
    device = target  # only devices merge: explicit generators keep their own stream
    nodes = sorted((n for s in group for n in s.nodes), key=lambda n: n.seq)
    seqs = [n.seq for n in nodes]
    position = {id(n): i for i, n in enumerate(nodes)}
    events: dict = {}
    after = None
    afters = [s.after for s in group if s.after is not None]
    if afters and len(afters) == len(group) and len({a.record_id for a in afters}) == 1:
        earlier = afters[0].record() if afters[0].record is not None else None
        after = _merged(earlier, target, afters, made)
    elif record is not None and target in record.entry:
        events[0] = ((-1, -1), OBSERVED, record.entry[target])
    for stream in group:
        for k, (seq, kind, value) in stream.events.items():
            if kind == OBSERVED:
                continue
            at = len(nodes) if k >= len(stream.nodes) else position[id(stream.nodes[k])]
            # The state was set when it happened, maybe before draws of the
            # other merged streams that came after it.
            at = min(at, bisect.bisect_left(seqs, seq[0]))
            if kind == SAME:
                value = position[id(stream.nodes[value])]
            elif kind == SET and stream.device.type != device.type:
                kind, value = "foreign", stream.device
            if at not in events or events[at][0] < seq:
                events[at] = (seq, kind, value)
    owner = min(group, key=lambda s: s.nodes[0].seq if s.nodes else -1)
    post = owner.merged.setdefault(cache_key, {})
    exit_state = record.exit.get(target) if record is not None else None
    rs = ReplayStream(
        target, device, nodes, events, post, after=after, left=[exit_state] if exit_state is not None else [],
        sources=group,
    )
    made[cache_key] = rs
    return rs
