"""What a replay must run: the closure of some reads and the random draws before them.

Shared by the interpreter (:mod:`deferinit.materialize.replay`), the printed graph
(:mod:`deferinit.view`) and the graphviz view, so it lives beside the graph.

* **The closure.**  To read a value at a version, replay its creator and the
  chain of writes to its storage up to that version, recursively.  Reads of
  a storage that is already real (a view or base materialized earlier)
  start from the real memory, so they need only the writes made since.
* **Random streams.**  A random node must draw from the state its generator
  had eagerly.  For every needed draw, the draws between the nearest known
  earlier state and it are planned too (their results are thrown away).
  When a load is among the reads, only the draws the liveness pass keeps
  live get theirs (a draw a load overwrites needs no state: planning each
  loaded parameter alone does not walk every earlier one's draw).
* **Devices.**  A :class:`DeviceMap` maps every recorded device to another
  one; draws recorded for several devices then come from one generator.
* **Dead work.**  Of all that, :mod:`deferinit.ir.liveness` keeps what the
  values read and the generator states of the live draws depend on: writes
  that later writes hide are dropped, tensors whose contents are all
  overwritten are only allocated, and draws needed only for the state they
  leave run into scratch memory.

Example (the bias needs the weight's draw only for the generator state it
leaves, so the weight itself is never allocated)::

    >>> m = deferred_init(torch.nn.Linear, 2, 3)
    >>> plan = Plan([read_of(m.bias)])
    >>> [(str(n.target), plan.mode(n)) for n in plan.order]
    [('aten.empty.memory_format', 'alloc'), ('aten.uniform_.default', 'generator'), ('aten.uniform_.default', 'run')]
"""

from __future__ import annotations

import torch

from deferinit.fake.device import normalize

from ..errors import ReplayError
from .graph import FreshRead, Input, Node, version_seq
from .effects import is_load
from .liveness import RUN, Liveness, whole_factories
from ..random.streams import ReplayStream, Stream, replay_streams


class DeviceMap:
    """Maps recorded devices to replay devices (identity when ``target`` is None)."""

    __slots__ = ("target",)

    def __init__(self, target=None):
        self.target = normalize(target) if target is not None else None

    def __call__(self, device: torch.device) -> torch.device:
        if self.target is None or device.type == "meta":
            return device
        return self.target

    def stream_key(self, key):
        if type(key) is not torch.device or self.target is None:
            return key
        return self.target


def real_read(inp: Input) -> bool:
    """Whether a read is served by a storage that is already real."""
    storage = inp.value._storage()  # Value.storage, without the property's call
    return (
        storage is not None
        and type(inp) is not FreshRead
        and storage.real is not None
        and version_seq(inp.version) >= version_seq(storage.real_head)
    )


def closure(reads, nodes=(), needed: dict | None = None) -> dict:
    """``id(node) -> node`` for every node the ``reads`` need (the creator of the
    value read and the writes to its storage up to the version read,
    recursively), plus ``nodes`` and what they need; added to ``needed``.

    Reads served by memory that is already real need only the writes made
    to it since.
    """
    needed = {} if needed is None else needed
    stack: list[Node] = list(nodes)

    def read(inp: Input) -> None:
        if real_read(inp):
            real_head = inp.value.storage.real_head
            if inp.version is not None and version_seq(inp.version) > version_seq(real_head):
                stack.append(inp.version)
            return
        stack.append(inp.value.node)
        if inp.version is not None:
            stack.append(inp.version)

    for inp in reads:
        read(inp)
    while stack:
        node = stack.pop()
        if id(node) in needed:
            continue
        needed[id(node)] = node
        for x in node.flat:
            if type(x) is Input:
                read(x)
    return needed


class Plan:
    """The nodes that reading ``targets`` (and running ``extra``, for their
    effect on the generators) needs, in recorded order, with the random
    streams they draw from (``streams``: ``id(record stream) -> ReplayStream``).

    Example::

        >>> m = deferred_init(torch.nn.Linear, 2, 3)
        >>> len(Plan([read_of(m.weight)]).order)
        2
    """

    def __init__(self, targets: list[Input], *, device=None, extra=(), eliminate: bool = True):
        self.targets = targets
        # Nodes replayed only for their effect on the generators.
        self.extra = list(extra)
        self.device_map = DeviceMap(device)
        self.streams: dict = {}
        self.order: list[Node] = []
        # Dead-work elimination (deferinit/ir/liveness.py); False plans the whole
        # record as written (the graph views show it so).
        self.eliminate = eliminate
        self.liveness: Liveness | None = None
        # When every node is one target's own factory call, each target's
        # whole value (see liveness.whole_factories), final once its node
        # ran: the targets' indices in recorded order; else None.
        self.whole: list[int] | None = None
        self._plan()

    def _plan(self) -> None:
        # Targets that are each their own factory call are their own closure.
        whole = whole_factories(self.targets, real_read) if self.eliminate and not self.extra else None
        needed = closure(self.targets, self.extra) if whole is None else dict(whole)
        seen: dict[int, Stream] = {}
        if whole is None and self.eliminate and any(is_load(n) for n in needed.values()):
            # A load hides the draws it overwrites: their generator states are
            # not needed, so grow the universe by the draws before the live
            # draws only (not before every draw: one load per parameter would
            # walk every earlier parameter's draw, quadratic in a model).
            while True:
                self._streams_of(needed, seen)
                self.liveness = liveness = Liveness(
                    self.targets, self.extra, needed, self.streams, real_read=real_read, closure=closure,
                    draws_before=draws_before)
                before = len(needed)
                closure((), draws_before(liveness.drawing(), self.streams), needed)
                if len(needed) == before:
                    break
            self._mark_planned(needed)
            self.order = liveness.order
            return

        # Random draws: replay, from the nearest known state, every draw up
        # to each needed one (their own inputs included), until nothing new.
        while True:
            positions = _grouped(self._streams_of(needed, seen), self.streams)
            before = len(needed)
            # While only the targets' factory calls are planned, only what
            # draws_before adds matters (see draws_outside).
            lean = whole is not None and before == len(whole)
            found = (_outside if lean else _before)(positions)
            closure((), found, needed)
            if len(needed) == before:
                break
        for rs, ks in positions:  # the random nodes of needed, the last pass's
            rs.planned.update(ks)

        if not self.eliminate or whole is not None and len(needed) == len(whole):
            # (All whole: every node is a target's one factory call, live as recorded.)
            if whole is None:
                self.order = sorted(needed.values(), key=lambda n: n.seq)
                return
            nodes = [inp.value.node for inp in self.targets]
            seqs = [node.seq for node in nodes]
            if all(a < b for a, b in zip(seqs, seqs[1:])):  # targets asked in recorded order (a module's)
                self.whole, self.order = list(range(len(nodes))), nodes
            else:
                self.whole = sorted(range(len(nodes)), key=seqs.__getitem__)
                self.order = [nodes[i] for i in self.whole]
            return
        # -- dead-work elimination: of everything the reads could need, what
        # their values and the live draws' generator states really depend on.
        # What the last pass found is draws_before of every draw planned: the
        # liveness pass, asking the same of the same draws, reuses it.
        asked = frozenset(id(n) for n in needed.values() if n.rng is not None and n.rng[0]() is not None)
        self.liveness = Liveness(
            self.targets, self.extra, needed, self.streams, real_read=real_read, closure=closure,
            draws_before=draws_before, known_before=(asked, found),
        )
        self.order = self.liveness.order

    def _streams_of(self, needed: dict, seen: dict) -> dict:
        """``self.streams`` for the random nodes of ``needed`` (their streams added
        to ``seen``); returns those nodes by record stream, ``id(stream) -> [nodes]``."""
        by_stream: dict = {}
        for node in needed.values():
            if node.rng is not None:
                stream = node.rng[0]()
                if stream is None:
                    raise ReplayError(f"the record of {node} is gone; it cannot be replayed")
                nodes = by_stream.get(id(stream))
                if nodes is None:
                    nodes = by_stream[id(stream)] = []
                    seen.setdefault(id(stream), stream)
                nodes.append(node)
        self.streams = replay_streams(list(seen.values()), self.device_map)
        return by_stream

    def _mark_planned(self, needed: dict) -> None:
        for node in needed.values():
            if node.rng is not None:
                rs = self.streams[id(node.rng[0]())]
                rs.planned.add(rs.index[id(node)])

    def mode(self, node: Node) -> str:
        """How the replay runs ``node``: ``"run"``, or see :mod:`deferinit.ir.liveness`."""
        return self.liveness.mode(node) if self.liveness is not None else RUN

    def reads(self, node: Node) -> list[Input]:
        """The inputs the replay resolves for ``node``."""
        if self.liveness is not None:
            return self.liveness.reads(node)
        return [x for x in node.flat if type(x) is Input]

    @property
    def replay_streams(self) -> list[ReplayStream]:
        return list({id(rs): rs for rs in self.streams.values()}.values())


def draws_before(nodes, streams: dict) -> list:
    """The draws to replay so that the state before each random node of ``nodes``
    is known (see :meth:`ReplayStream.needs_all`), each once."""
    return _before(_positions(nodes, streams))


def _before(positions) -> list:
    found = []
    for rs, ks in positions:
        found.extend(rs.needs_all(ks))
    return found


def draws_outside(nodes, streams: dict) -> list:
    """The draws of :func:`draws_before` that are not among ``nodes`` (and maybe
    some that are), found without walking back from each draw where a
    stream's draws among ``nodes`` are one run with no event inside (a
    model's parameters, drawn in order): there a walk leaves the run only
    through its first draw (no state put back inside jumps over it)."""
    return _outside(_positions(nodes, streams))


def _outside(positions) -> list:
    found = []
    for rs, ks in positions:
        ks.sort()
        lo, hi = ks[0], ks[-1]
        if hi - lo + 1 == len(ks) and not any(lo < k <= hi for k in rs.events):
            ks = [lo]
        found.extend(rs.needs_all(ks))
    return found


def _grouped(by_stream: dict, streams: dict):
    """:func:`_positions` of random nodes already grouped by record stream
    (``id(stream) -> [nodes]``, see :meth:`Plan._streams_of`)."""
    found: dict = {}
    for key, nodes in by_stream.items():
        rs = streams.get(key)
        if rs is not None:
            index = rs.index
            ks = [index[id(node)] for node in nodes]
            entry = found.get(id(rs))
            if entry is None:
                found[id(rs)] = (rs, ks)
            else:
                entry[1].extend(ks)
    return found.values()


def _positions(nodes, streams: dict):
    """``(replay stream, [positions])`` of the random nodes of ``nodes``, by stream."""
    by_stream: dict = {}
    for node in nodes:
        if node.rng is not None:
            rs = streams.get(id(node.rng[0]()))
            if rs is not None:
                by_stream.setdefault(id(rs), (rs, []))[1].append(rs.index[id(node)])
    return by_stream.values()


def read_of(fake) -> Input:
    """The read of a deferred fake as it is now (its value at its storage's head)."""
    return Input(fake._value, fake._storage.head)
