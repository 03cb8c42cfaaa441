"""A record: what one ``deferred_init`` call needs to replay its tensors exactly.

The graph lives in nodes reachable from the fakes (which hold their record;
the graph never does).  The record keeps what is not reachable that way:
each generator's stream of random nodes, temporaries included, what user
code did to the generators, and their real states when recording started
and stopped.  Default generators, shared by every thread, are never
written; explicit ones are *marked* after each draw (seeded with a tag
standing for "right after draw d") and given back their state at the end.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch

from deferinit.fake.guard import register
from deferinit.fake.locking import holding, locked

from ..ir.graph import event_seq, peek_seq
from .rng import (
    CPU, CPU_GENERATOR, OBSERVED, SAME, SEED, SET, GeneratorKey, current_seed, fingerprint, generator_of,
    get_state, gettable, initialized_generators, new_tag, seeded_state, set_state,
)
from .streams import Stream

_ids = itertools.count(1)


class Record:
    """The session state of one ``deferred_init`` call (nested calls share it)."""

    __slots__ = (
        "id", "label", "base", "streams", "entry", "entry_seed", "exit", "parents", "open", "markers",
        "seeds", "lineage", "closed", "abandoned", "__weakref__",
    )

    def __init__(self, label: str = ""):
        self.id = next(_ids)
        self.label = label
        # Printed node numbers count from here (deferinit.view).
        self.base = peek_seq()
        self.streams: dict = {}
        # Real generator states when recording started / stopped, by stream key.
        # The CPU stream starts from its entry state, whatever other threads
        # draw meanwhile; its seed then, for _observe (read in this order: a
        # seed another thread sets in between is told apart).
        epoch = FOREIGN.epoch
        self.entry: dict = {CPU: get_state(CPU_GENERATOR)}
        self.entry_seed = (epoch, current_seed(CPU_GENERATOR))
        self.exit: dict = {}
        # Records whose tensors fed ops of this one: kept alive with it.
        self.parents: set = set()
        self.open = True
        # Tag of a marked explicit generator -> (stream, draw whose post-state it stands for).
        self.markers: dict = {}
        # manual_seed calls for every generator of a kind: (seq, device type or None, seed).
        self.seeds: list = []
        # Default generator key -> the LINEAGE node naming its eager state
        # right after this record's construction (set on close).
        self.lineage: dict = {}
        self.closed = False  # close() ran to its end
        # The deferral failed or was interrupted (see abandon()).
        self.abandoned = False

    # -- streams ------------------------------------------------------------------

    def stream(self, key) -> Stream:
        """The stream of ``key``, made on first use with what is known of its start."""
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = Stream(key, self)
            if type(key) is not GeneratorKey:
                self._start(stream)
        return stream

    def _start(self, stream: Stream) -> None:
        key = stream.key
        seed = self._latest_seed(key)
        if seed is not None:
            stream.events[0] = seed
        elif not self.open:
            # A draw after deferred_init returned continues from where
            # construction left the generator.
            state = self.exit.get(key)
            if state is not None:
                stream.events[0] = (event_seq(), OBSERVED, state)
        else:
            state = self.entry.get(key)
            if state is None and stream.generator is not None:
                state = get_state(stream.generator)
            previous = CHAINS.find(key, state)
            if previous is not None:
                stream.after = previous  # two models deferred back to back
            elif state is not None:
                stream.events[0] = (event_seq(), OBSERVED, state)
        if stream.generator is not None and self.open:
            if key == CPU:
                stream.since, stream.observed = self.entry_seed
            else:
                stream.since, stream.observed = FOREIGN.epoch, current_seed(stream.generator)

    def _latest_seed(self, key):
        for seq, kind, seed in reversed(self.seeds):
            if kind is None or kind == key.type:
                return (seq, SEED, seed)
        return None

    def seed(self, seed: int, kind: str | None = None, device: torch.device | None = None) -> None:
        """User code called ``manual_seed(seed)`` for every default generator (``kind``
        None), every one of a device type, or one device's."""
        if device is None:
            self.seeds.append((event_seq(), kind, seed))
        for key, stream in self.streams.items():
            if type(key) is GeneratorKey:
                continue
            if (device is not None and key == device) or (device is None and kind in (None, key.type)):
                stream.event(len(stream.nodes), SEED, seed)
        if device is not None and device not in self.streams:
            self.stream(device).event(0, SEED, seed)

    # -- draws --------------------------------------------------------------------

    def add_random(self, node, key, target=None) -> None:
        """Append random ``node`` to the stream of ``key``; ``target`` is the storage it
        writes or makes (a draw whose storage nobody holds any more is a temporary)."""
        stream = self.stream(key)
        index = len(stream.nodes)
        stream.nodes.append(node)
        node.rng = (stream.ref, index)
        if target is not None:
            node.rng_target = weakref.ref(target)
        gen = stream.generator
        if gen is None or not self.open:
            return
        if type(key) is GeneratorKey:
            self._mark(stream, index, gen)
            return
        self._observe(stream, index)

    def _observe(self, stream: Stream, k: int) -> None:
        """Notice, right before draw ``k``, that this thread set a default generator
        by a call torch's Python API does not see (``manual_seed`` on a
        reference to the generator object kept from before recording,
        ``torch.cuda.default_generators[i]``): eager draws from that state.

        Only the seed is compared (the cheap check of every draw): draws do
        not change it, so another thread drawing from the shared generator
        is not taken for this thread's doing, and seeds other threads set
        through torch's API are told apart (:data:`FOREIGN`)."""
        since = FOREIGN.epoch
        seed = current_seed(stream.generator)
        if seed != stream.observed and stream.observed is not None:
            since, seed, state = FOREIGN.look(stream.key, stream.generator, stream.since)
            if state is not None:
                stream.event(k, SET, state)
            stream.observed = seed
        stream.since = since

    def observe(self, key) -> None:
        """Bring the stream of ``key`` up to date with what this thread did to its
        generator since the last draw, before answering ``get_rng_state`` or
        ``initial_seed``, or computing the state the next draw starts from
        (a random op on a real tensor, :mod:`deferinit.random.realdraws`)."""
        stream = self.streams.get(key)
        if stream is None or not self.open or stream.generator is None:
            return
        if type(key) is GeneratorKey:
            self._check_mark(stream, len(stream.nodes), stream.generator)
        elif stream.observed is not None:
            self._observe(stream, len(stream.nodes))

    def _mark(self, stream: Stream, index: int, gen: torch.Generator) -> None:
        self._check_mark(stream, index, gen)
        tag = new_tag()
        # Known before the generator carries it: an interrupt in between leaves
        # a tag close() still recognises and gives back.
        self.markers[tag] = (stream, index)
        torch._C.Generator.manual_seed(gen, tag)

    def _check_mark(self, stream: Stream, index: int, gen: torch.Generator) -> None:
        """What user code did to explicit generator ``gen`` since draw ``index - 1``
        (idempotent until the generator is marked again)."""
        mark = self.markers.get(torch._C.Generator.initial_seed(gen))
        if mark is not None and mark[0] is stream:
            if mark[1] != index - 1:
                stream.event(index, SAME, mark[1])  # an older state put back
        else:
            # First draw, or user code set the generator since the last one.
            state = get_state(gen)
            stream.event(index, SET if index else OBSERVED, state)
            stream.base = state

    def close(self) -> None:
        """Recording stopped: unmark the explicit generators, remember the real states.

        Idempotent, and safe to run again after an interrupt stopped it: an
        explicit generator given back its state is unmarked first and then
        forgotten, so a second run finds it as user code left it."""
        if self.closed:
            return
        self.open = False
        for key, stream in self.streams.items():
            gen = stream.generator
            if type(key) is not GeneratorKey or gen is None or stream.base is None:
                continue
            mark = self.markers.get(torch._C.Generator.initial_seed(gen))
            end = len(stream.nodes)
            if mark is not None and mark[0] is stream:
                set_state(gen, stream.base)
                stream.base = None  # given back (a second close leaves it alone)
                if mark[1] != end - 1:
                    stream.event(end, SAME, mark[1])  # an older state put back after the last draw
            else:
                # User code set the generator after the last draw: eager
                # construction ends there.
                stream.event(end, SET, get_state(gen))
        self.markers.clear()
        if self.abandoned:
            # Nothing of it happened: no state user code set, no eager draws to continue.
            self.closed = True
            return
        for key in {CPU, *self.streams}:
            if type(key) is not GeneratorKey and gettable(key):
                self._settle(key)
        for key in {CPU, *self.streams}:
            if gettable(key):
                gen = generator_of(key)
                if gen is not None:
                    self.exit[key] = get_state(gen)
        for key in {CPU, *(k for k, s in self.streams.items() if type(k) is not GeneratorKey and s.nodes)}:
            # Eagerly the generator has moved by this record's draws: a new name
            # for its state, whose parent is the state before them.
            self.lineage[key] = LINEAGE.advance(key, self)
        for key, stream in self.streams.items():
            if type(key) is not GeneratorKey and stream.nodes:
                CHAINS.register(self, key, self.exit.get(key))
        self.closed = True

    def _settle(self, key) -> None:
        """Put the default generator of ``key`` in the last state user code set while
        recording (as eager construction did, the draws since apart).  Only
        states the user asked for are written, never a marker."""
        gen = generator_of(key)
        stream = self.streams.get(key)
        if stream is not None and stream.observed is not None:
            self._observe(stream, len(stream.nodes))  # set by a C++ call after the last draw
        latest = self._latest_seed(key)
        if stream is not None:
            for k, event in stream.events.items():
                if event[1] in (SET, SEED) and (latest is None or event[0] > latest[0]):
                    latest = event
        if latest is None:
            return
        # User code in the constructor seeded or set the generator: eagerly that
        # wipes out the draws of earlier deferrals still pending, even when the
        # state it sets is the one the generator holds.
        LINEAGE.reseed(keys=(key,))
        state = latest[2] if latest[1] == SET else seeded_state(key, latest[2])
        if fingerprint(get_state(gen)) != fingerprint(state):
            FOREIGN.set_state(gen, state)

    def abandon(self) -> None:
        """The deferral that made this record failed or was interrupted: it leaves
        the generators as they were, so its draws count as never made.  The
        next record must not continue its streams (:class:`Chains`), even while
        something keeps it alive (the exception's traceback holds its frames:
        ``sys.last_value`` at a prompt, a handler keeping the exception).  Set
        before :meth:`close`; also after it, which then only stops the chaining.

        Example::

            >>> record = Record("M")
            >>> record.abandon(); record.close()
            >>> record.closed, record.chained
            (True, False)
        """
        self.abandoned = True

    @property
    def chained(self) -> bool:
        """Whether the next record may continue this one's streams (see :data:`CHAINS`)."""
        return any(type(k) is not GeneratorKey and s.nodes for k, s in self.streams.items())

    def __repr__(self) -> str:
        return f"<Record {self.id} {self.label}>"


class Chains:
    """The last record that drew from each default generator, so that the next
    one recorded continues its stream, as eager construction would.

    A record continues another when the generator's real state is still the
    one that record left and its eager state still follows from that
    record's (:class:`Lineage`: no seed or state was set through torch's API
    since, unless it put back a state read since); only while the earlier
    record is alive.  ``bump`` counts every seed or state set, for
    :mod:`deferinit.random.pending`.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._last: dict = {}
        self._epoch = 0

    @holding("_lock")
    def bump(self) -> None:
        """User code set a generator for real (torch.manual_seed, set_rng_state...)."""
        self._epoch += 1

    @holding("_lock")
    def register(self, record: Record, key, state: torch.Tensor | None) -> None:
        """``record`` drew from ``key``'s generator, which it left in ``state`` (None:
        a generator this process cannot read, fake CUDA)."""
        print_ = fingerprint(state) if state is not None else None
        self._last[key] = (weakref.ref(record), print_, self._epoch)

    def find(self, key, state: torch.Tensor | None) -> Stream | None:
        entry = locked(self._lock, self._last.get, key)
        if entry is None:
            return None
        ref, print_, _ = entry
        record = ref()
        if record is None or record.abandoned or not LINEAGE.descends(key, record.lineage.get(key)):
            return None  # gone, failed, or a seed or state was set since it closed
        if print_ != (fingerprint(state) if state is not None else None):
            return None
        return record.streams.get(key)


CHAINS = Chains()


class Lineage:
    """Names for the state each default generator has *eagerly*, so that a reseed
    between a deferral and its materialization is noticed, even one to the very
    state the generator holds (the hand-over,
    :mod:`deferinit.materialize.generators`, waits then).

    Closing a record names the state after its draws, a child of the state
    before (:meth:`advance`); a seed or a set state is a new root
    (:meth:`reseed`); a state read and set back (``fork_rng``'s exit) carries
    the name it was read under (:meth:`read`, :meth:`restored`).  A record's
    draws are pending while the generator's name descends from the one its
    close gave (:meth:`descends`).  The diverted generator API
    (:mod:`deferinit.random.seeding`) tells it what user code does.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._clock = itertools.count(1)
        self._parent: dict[int, int | None] = {}
        self._current: dict = {}  # generator key -> name
        self._base = 0  # the name of keys not seen yet (every generator seeded)
        self._kind: dict[str, int] = {}  # device type -> name of its keys not seen yet
        self._read: dict[int, tuple] = {}  # id(state tensor) -> (weakref, key, name)
        self._held: dict[int, weakref.ref] = {}  # name -> the record that drew under it
        self._prune_at = 1024

    def _new(self, parent) -> int:
        name = next(self._clock)
        self._parent[name] = parent
        if len(self._parent) > self._prune_at:
            self._prune(name)
        return name

    def _prune(self, new: int) -> None:
        # A name is asked about only while a record holds it (descends,
        # revivable), a generator is under it, or a state read under it is
        # alive: every other name is only a link, and the links are shortened
        # past it, so that deferrals without a reseed do not grow the table.
        keep = {new, self._base, *self._current.values(), *self._kind.values()}
        keep.update(read for _, _, read in self._read.values())
        keep.update(name for name, ref in list(self._held.items()) if ref() is not None)
        parent = self._parent
        kept = {}
        for name in keep:
            up = parent.get(name)
            while up is not None and up not in keep:
                up = parent.get(up)
            kept[name] = up
        self._parent = kept
        self._prune_at = max(1024, 2 * len(kept))

    def _now(self, key) -> int:
        name = self._current.get(key)
        if name is None:
            name = max(self._base, self._kind.get(key.type, 0))
            self._current[key] = name
        return name

    @holding("_lock")
    def advance(self, key, holder=None) -> int:
        """A record (``holder``) drew from ``key``'s generator: the eager state's new name."""
        name = self._current[key] = self._new(self._now(key))
        if holder is not None:
            self._held[name] = weakref.ref(holder, lambda _, n=name: self._held.pop(n, None))
        return name

    @holding("_lock")
    def reseed(self, keys=None, kind: str | None = None) -> None:
        """User code seeded or set generators: ``keys``, every one of device type
        ``kind``, or (both None) every default generator."""
        name = self._new(None)
        if keys is None and kind is None:
            self._base = name
            self._current = {k: name for k in self._current}
        elif keys is None:
            self._kind[kind] = name
            for k in self._current:
                if k.type == kind:
                    self._current[k] = name
        else:
            for k in keys:
                self._current[k] = name

    @holding("_lock")
    def read(self, key, state) -> None:
        """``state`` was read from ``key``'s generator (``get_rng_state``)."""
        if not isinstance(state, torch.Tensor):
            return
        token = id(state)
        self._read[token] = (weakref.ref(state, lambda _, t=token: self._read.pop(t, None)), key, self._now(key))

    def restored(self, key, state) -> None:
        """``key``'s generator was set to ``state``: back to the eager state it was
        read in, if it was read from that generator, else a reseed."""
        if not self._back(key, state):
            self.reseed(keys=(key,))

    @holding("_lock")
    def _back(self, key, state) -> bool:
        found = self._read.get(id(state)) if isinstance(state, torch.Tensor) else None
        if found is not None and found[0]() is state and found[1] == key:
            self._current[key] = found[2]
            return True
        return False

    @holding("_lock")
    def revivable(self, key, name) -> bool:
        """Whether a state read from ``key``'s generator under ``name`` or a name
        following it is still alive: set back, it would put that state in force."""
        for ref, k, read in list(self._read.values()):
            if k != key or ref() is None:
                continue
            while read is not None:
                if read == name:
                    return True
                read = self._parent.get(read)
        return False

    @holding("_lock")
    def descends(self, key, name) -> bool:
        """Whether the eager state of ``key``'s generator is ``name`` or follows it by
        records' draws only (True for None: nothing known to compare)."""
        if name is None:
            return True
        now = self._now(key)
        while now is not None:
            if now == name:
                return True
            now = self._parent.get(now)
        return False


LINEAGE = Lineage()


class Foreign:
    """The seeds other threads gave the default generators through torch's API
    (``torch.manual_seed``, ``set_rng_state``...) while some thread records.

    A recording thread notices C++-level changes by the seed
    (:meth:`Record._observe`) and must not follow another thread's.  Those
    threads' calls are diverted to :meth:`setting`, which makes the change
    and logs the resulting seeds under the lock a recording thread takes
    when it sees a new seed.
    """

    _KEEP = 64  # sets remembered per generator

    def __init__(self):
        # Reentrant: torch.manual_seed calls torch.cuda.manual_seed_all, diverted too.
        self._lock = threading.RLock()
        self._log: dict = {}
        self.epoch = 0

    @holding("_lock")
    def setting(self, original, *args, **kwargs):
        """``original(*args, **kwargs)``, a call of another thread that sets generators."""
        try:
            return original(*args, **kwargs)
        finally:
            self.epoch += 1
            for key, gen in initialized_generators():
                log = self._log.setdefault(key, [])
                log.append((self.epoch, current_seed(gen)))
                del log[: -self._KEEP]

    def set_state(self, gen: torch.Generator, state: torch.Tensor) -> None:
        """Put default generator ``gen`` in ``state`` for deferinit's own ends (a
        record closing settles it, a materialization hands it over, a replay
        borrows it for an operator without a ``generator`` argument): logged as
        another thread's call is, so that no thread recording meanwhile takes
        the seed that comes with ``state`` for its own doing."""
        self.setting(set_state, gen, state)

    @holding("_lock")
    def look(self, key, gen: torch.Generator, since: int):
        """Default generator ``gen`` (of ``key``), whose seed changed since epoch
        ``since``, read under the lock the diverted calls set it under:
        ``(epoch, seed, state)``, ``state`` None when the seed is the one the
        latest of those calls left after ``since`` (another thread's doing),
        else the generator's state (this thread's own change).  Read under
        the lock: a seed read before may have left the log (``_KEEP``).

        Example::

            >>> foreign = Foreign()
            >>> since = foreign.epoch
            >>> _ = foreign.setting(torch.manual_seed, 7)   # another thread's torch.manual_seed(7)
            >>> foreign.look(CPU, CPU_GENERATOR, since)[1:]
            (7, None)
            >>> _ = CPU_GENERATOR.manual_seed(8)           # a kept reference: nobody logged it
            >>> foreign.look(CPU, CPU_GENERATOR, since)[2] is None
            False
        """
        seed = current_seed(gen)
        log = self._log.get(key)
        if log and log[-1][1] == seed and log[-1][0] > since:
            return self.epoch, seed, None
        return self.epoch, seed, get_state(gen)


FOREIGN = Foreign()


class _Local(threading.local):
    def __init__(self) -> None:
        self.records: list[Record] = []


_local = _Local()
# An interrupted call leaves this thread's record stack as it found it.
register(lambda: len(_local.records), lambda n: _local.records.__delitem__(slice(n, None)))


def current_record() -> Record | None:
    """The record of the innermost ``deferred_init`` running in this thread."""
    records = _local.records
    return records[-1] if records else None


def open_records() -> list[Record]:
    """The records of the ``deferred_init`` calls running in this thread, innermost last."""
    return _local.records
