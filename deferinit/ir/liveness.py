"""Dead-work elimination: which planned nodes a replay must run, and how.

A write that covers a tensor without reading it (``copy_`` of its whole
extent, ``fill_``, ``zero_``, a random fill, a loaded checkpoint) hides every
earlier write to those bytes; so does ``.data =``, which simply moves the
tensor to other memory.  Replaying hidden work changes nothing but the
time, the memory and the random generators.  This pass walks the closure of
a replay backwards, in recorded order, and keeps per storage the byte
regions whose contents are still *demanded* (read by a live node or
requested) at that point of the record:

* a write is **live** when it writes demanded bytes; if it covers them
  without reading them, they stop being demanded before it;
* a node that creates a tensor whose *object* is needed (to be written
  into, viewed or read) but whose contents are all hidden is replayed as an
  **allocation** of the same geometry (no kernel, no random draw);
* a factory of one constant (``zeros``, ``full``, ``new_zeros``) whose
  bytes later writes mostly cover is allocated and filled only between the
  first and the last byte still demanded (FSDP2's padded shards: the
  padding), as a random fill draws only a shard's rows;
* a view only needs its base's object, ``empty_like``-like factories only
  their input's geometry: neither demands contents;
* a ``copy_`` from a tensor whose bytes come straight from a checkpoint
  load reads the checkpoint into its destination **directly**, and a load
  (or such a copy) whose tensor is only partly demanded reads only those
  parts: a shard cut from a loaded parameter reads the shard's bytes only.

Random draws whose results are dead still move the generator: a later live
draw of the same stream may need the state they leave.  Those draws (and
only those, with the ``extra`` draws a caller asks for to learn a stream's
end) are replayed **for the generator**: in-place fills draw into scratch
memory of the same geometry, freed at once.  Dead draws that a *load* hides
(a checkpoint load, or a ``copy_`` from a real tensor made after deferral,
as ``load_state_dict`` makes: :func:`~deferinit.ir.effects.is_load`) are
remembered in this pass's own table (:func:`hidden_by_load`; the graph
holds no analysis results): :mod:`deferinit.materialize.generators` does not
replay them to reach the end of a stream.

Two lanes skip the per-region bookkeeping where its answer is known: a
target whose whole history is one factory call runs it as recorded, and
one made by a factory and then one covering write that nothing else in the
replay reads or writes (``empty`` then ``uniform_``, as ``nn.Linear`` makes
its weight) runs the write and allocates the factory's output.

Values whose storage is gone (temporaries nobody holds any more) and
storages whose geometry changed in place (``t_()``, ``set_()``) are not
analysed: their reads need their whole history, as before.

Example::

    >>> from deferinit.ir.plan import Plan, read_of
    >>> m = deferred_init(torch.nn.Linear, 2, 3)
    >>> with torch.no_grad():
    ...     _ = m.weight.fill_(1.0)         # hides the uniform_ of reset_parameters
    >>> plan = Plan([read_of(m.weight)])
    >>> [(str(n.target), plan.mode(n)) for n in plan.order]
    [('aten.empty.memory_format', 'alloc'), ('aten.fill_.Scalar', 'run')]
"""

from __future__ import annotations

import weakref

import torch

from .effects import (
    ELEMENTWISE_COPIES, GEOMETRY_ONLY, allocatable, constant_fill, copied_parts, direct_copy, direct_parts, drawn_part,
    is_load, load_parts, overwrites, root_value,
)
from deferinit.fake.opinfo import op_info

from .graph import Input, version_seq
from .regions import Region

aten = torch.ops.aten

RUN = "run"
ALLOC = "alloc"  # allocate the outputs' memory, compute nothing
GENERATOR = "generator"  # only for the state it leaves the generator in
DIRECT = "direct"  # a copy_ that reads a checkpoint straight into its destination

_HUGE = 1 << 62

# Draws whose values only loads overwrite, as any replay so far found them;
# a draw leaves with its node.
_HIDDEN_BY_LOAD: weakref.WeakSet = weakref.WeakSet()


def hidden_by_load(node) -> bool:
    """Whether a liveness pass found that only checkpoint loads (or
    ``load_state_dict``'s copies) overwrite the values random ``node`` draws:
    the generators do not wait for it (it is the initialization the load
    replaces)."""
    return node in _HIDDEN_BY_LOAD

# id(op) -> (makes a view, needs only its input's geometry, copies it
# elementwise, is copy_): asked once per kind of node, not per node
# (OpOverload's hash is Python code).
_OP_FLAGS: dict = {}


def _op_flags(op) -> tuple:
    found = _OP_FLAGS.get(id(op))
    if found is None:
        found = _OP_FLAGS[id(op)] = (
            op_info(op).view_arg is not None, op in GEOMETRY_ONLY, op in ELEMENTWISE_COPIES, op is aten.copy_.default,
        )
    return found


_NOT_OP = (False, False, False, False)


def _factory(node) -> bool:
    """A call that reads and writes no recorded tensor (randn, empty, a constant)."""
    return not node.writes and not node.reshapes and Input not in map(type, node.flat)


def _whole(inp, real_read) -> bool:
    """A target whose whole history is one factory call (a randn, a constant):
    nothing writes its storage, so that call is live, run as recorded."""
    return inp.version is None and 0 not in inp.value.size and _factory(inp.value.node) and not real_read(inp)


def _constant_part(node, outs, seq, demanded):
    """``(lo, hi, number)``: the elements of a constant factory's contiguous
    output that later reads meet (see :func:`~deferinit.ir.effects.drawn_part`),
    when that is not all of them; else None (also for any other node, asked
    first: the scan asks it of every live factory)."""
    if len(outs) != 1 or 0 not in outs:
        return None
    number = constant_fill(node)
    if number is None:
        return None
    region, _, found = demanded(outs[0], seq)
    part = drawn_part(outs[0], region, found) if region is not None else None
    return None if part is None else (*part, number)


def whole_factories(targets, real_read) -> dict | None:
    """``id(node) -> node`` of the factory calls of ``targets``, one each (see
    :func:`_whole`), or None if a target is not such a call: then that is
    their closure, every node live, run as recorded, and no scan is needed
    unless earlier draws join it (a model of random parameters made whole).

    Example::

        >>> from deferinit.ir.plan import Plan, read_of
        >>> ps = deferred_init(lambda: torch.nn.ParameterList([torch.nn.Parameter(torch.randn(2))]))
        >>> Plan([read_of(ps[0])]).liveness is None       # all whole: planned without the scan
        True
    """
    found: dict = {}
    # _whole and _factory inlined (asked of every tensor of a model of many
    # small ones); real_read only of a storage already real.
    for inp in targets:
        value = inp.value
        node = value.node
        if inp.version is not None or node.writes or node.reshapes or 0 in value.size:
            return None
        for x in node.flat:
            if type(x) is Input:
                return None
        storage = value._storage()
        if storage is not None and storage.real is not None and real_read(inp):
            return None
        found[id(node)] = node
    # Two targets of one call (two reads of one value) are not each their own.
    return found if len(found) == len(targets) else None


# Off only to compare the lane with the general scan (tests/deferinit/test_liveness_lanes.py).
_FILL_LANE = True

# id(op) -> (op, it returns one tensor).
_ONE_OUTPUT: dict = {}


def _one_output(op) -> bool:
    found = _ONE_OUTPUT.get(id(op))
    if found is None:
        found = _ONE_OUTPUT[id(op)] = (op, type(op) is torch._ops.OpOverload and len(op._schema.returns) == 1)
    return found[1]


# id(op) -> (op, overwrites() of a call of it that writes its first argument).
_OVERWRITING: dict = {}


def _overwrites(write) -> bool:
    """:func:`~deferinit.ir.effects.overwrites` of a write of ``(0,)`` that reshapes nothing."""
    if write.kind == "opaque":
        return True
    if write.kind != "op":
        return False
    found = _OVERWRITING.get(id(write.target))
    if found is None:
        found = _OVERWRITING[id(write.target)] = (write.target, overwrites(write))
    return found[1]


# (size, stride, itemsize) -> whether a value of that geometry is one run of bytes.
_DENSE: dict = {}


def _dense(value) -> bool:
    """``Region.of(value).dense``, asked once per geometry (most tensors of a model share a few)."""
    key = (value.size, value.stride, value.dtype.itemsize)
    found = _DENSE.get(key)
    if found is None:
        found = Region.of(value).dense
        if len(_DENSE) < 4096:
            _DENSE[key] = found
    return found


def _filled(targets, universe: dict, real_read) -> tuple[dict, dict]:
    """The targets whose whole history is a factory call and then one write
    that covers its output without reading it (``empty`` then ``uniform_``),
    with nothing else in ``universe`` reading or writing that storage:
    ``({id(write): write}, {id(factory): {index: value}})``, the writes run as
    recorded, the factories only allocated (their contents are all hidden)."""
    found = {}  # id(storage) -> (write, factory, value), or None: not in the lane
    for inp in targets:
        write = inp.version
        if write is None:
            continue
        value = inp.value
        storage = value._storage()
        if storage is None:
            continue
        sid = id(storage)
        if sid in found:
            found[sid] = None  # two targets on one storage
            continue
        flat = write.flat
        first = flat[0] if flat else None
        factory = value.node
        # Cheapest questions first; allocatable() and _factory() inlined (once per tensor).
        found[sid] = (write, factory, value) if (
            type(first) is Input and first.value is value and first.version is None
            and write.writes == (0,) and not write.reshapes and factory.kind == "op"
            and not factory.writes and not factory.reshapes and value.offset == 0 and 0 not in value.size
            and _one_output(factory.target) and _overwrites(write) and Input not in map(type, flat[1:])
            and Input not in map(type, factory.flat) and not real_read(inp) and _dense(value)
        ) else None
    found = {k: v for k, v in found.items() if v is not None}
    if not found:
        return {}, {}
    # How many reads of each of those storages the replay makes: the write's own only.
    reads = dict.fromkeys(found, 0)
    for sid in [
        id(x.value._storage()) for node in universe.values() for x in node.flat if type(x) is Input
    ]:
        if sid in reads:
            reads[sid] += 1
    fills, allocated = {}, {}
    for sid, (write, factory, value) in found.items():
        if reads[sid] == 1:
            fills[id(write)] = write
            allocated[id(factory)] = {value.index: value}
    return fills, allocated


class Liveness:
    """What a replay of ``universe`` (``id -> node``: the closure of ``targets``
    and ``extra`` with every draw the random streams may need) must run.

    ``order`` lists the nodes to replay in recorded order; ``mode(node)``
    says how (``"run"``, ``"alloc"``, ``"generator"``, ``"direct"``);
    ``reads(node)`` the inputs the replay resolves for it.  A target's whole
    storage is demanded, not only its own bytes: once real, the storage
    serves later reads of its other views.
    """

    def __init__(self, targets, extra, universe: dict, streams: dict, *, real_read, closure, draws_before,
                 known_before=None):
        # The plan's real_read, closure and draws_before (passed in: the plan imports this module).
        self._real_read = real_read
        self._full_closure = closure
        self._draws_before = draws_before
        # ``(ids of draws, draws_before of them)``, if the plan has it already.
        self._known_before = known_before
        self.targets = targets
        self.universe = universe
        self.streams = streams
        # ``extra``: draws replayed only for the state they leave (the ends of
        # streams, see materialize/generators.py).
        self._settle({id(n) for n in extra})
        if any(is_load(n) for n in universe.values()):
            # What the loads hide: the generators do not wait for
            # those draws (they are the initialization a load replaces).
            for nid in self._hidden_by_loads():
                node = universe[nid]
                if node.rng is not None:
                    _HIDDEN_BY_LOAD.add(node)

    def _settle(self, gen: set) -> set:
        """Scan until every draw a drawing node needs is drawn; returns the draws
        replayed for the generator only."""
        while True:
            self.__dict__.update(self._scan(gen))
            new = self._draws_needed()
            if new <= gen:
                return gen
            gen = gen | new

    def _hidden_by_loads(self) -> set:
        """The nodes that are dead, or only allocated, because loads (a checkpoint,
        ``load_state_dict``) overwrite their results (they run if loads read what
        they write over): a random factory a load fills is allocated, not drawn."""
        without = self._scan(set(), loads_hide=False)
        return {
            nid for nid in without["live"]
            if nid not in self.live or (self.modes.get(nid) == ALLOC and without["modes"].get(nid) != ALLOC)
        }

    # -- the backward scan ------------------------------------------------------

    def _scan(self, gen: set, loads_hide: bool = True) -> dict:
        """One backward pass; ``loads_hide=False`` treats loads as writes that read
        what they overwrite (to see what they hide)."""
        real_read, closure = self._real_read, self._full_closure
        modes: dict = {}
        allocs: dict = {}
        scratches: dict = {}
        loads: dict = {}
        directs: dict = {}
        filled: dict = {}  # id(node) -> (lo, hi, value): ALLOC'd, elements [lo, hi) filled with value
        parts: dict = {}
        live: dict = {}
        objects: dict = {}  # id(node) -> {index: value}: tensors whose object is needed
        pending: dict = {}  # storage key -> [(region, floor seq)]
        forced: dict = {}  # id(node) -> node: whole history of unanalysed reads
        keys: dict = {}
        regions: dict = {}

        def region_of(value):
            r = regions.get(id(value), False)
            if r is False:
                r = regions[id(value)] = Region.of(value)
            return r

        def key_of(value):
            k = keys.get(id(value))
            if k is None:
                storage = value.storage
                if storage is not None:
                    k = ("storage", id(storage))
                else:
                    root = root_value(value)
                    k = ("root", id(root.node), root.index) if root is not None else None
                keys[id(value)] = k
            return k

        def need(inp) -> None:
            if not real_read(inp):
                objects.setdefault(id(inp.value.node), {})[inp.value.index] = inp.value

        def demand(inp, region=None) -> None:
            value = inp.value
            if real_read(inp):
                head = value.storage.real_head
                if version_seq(inp.version) <= version_seq(head):
                    return
                floor = version_seq(head)
            else:
                need(inp)
                floor = -1
            if region is None:
                region = region_of(value)
                if region is None:
                    return
            k = key_of(value)
            if k is None:
                closure([inp], (), forced)
                return
            pending.setdefault(k, []).append((region, floor))

        def demanded(value, seq):
            """The demands on ``value``'s storage, at ``seq``, that its bytes meet."""
            region = region_of(value)
            k = key_of(value)
            if region is None or k is None:
                return region, k, []
            items = [d for d in pending.get(k, ()) if d[1] < seq]
            return region, k, [d for d in items if d[0].intersects(region)]

        def kill(k, region, seq) -> None:
            items = pending.get(k)
            if not items:
                return
            left = []
            for r, floor in items:
                if floor < seq:
                    left.extend((piece, floor) for piece in r.minus(region))
                else:
                    left.append((r, floor))
            pending[k] = left

        # The fast lane: targets whose whole history is one factory call (a
        # randn, a constant): nothing writes their storage, so that call is
        # live, run as recorded, whatever else is demanded of it.
        whole = set()
        # The second lane: a factory whose output one write covers before
        # anything else touches its storage (``empty`` then ``uniform_``, as
        # nn.Linear makes its weight): the write runs, the factory only
        # allocates (what the backward scan finds for them, without its
        # bookkeeping per byte region).
        fills, allocated = _filled(self.targets, self.universe, real_read) if _FILL_LANE else ({}, {})
        for inp in self.targets:
            value = inp.value
            if _whole(inp, real_read):
                whole.add(id(value.node))
                continue
            if id(inp.version) in fills:
                continue
            region = None
            if not real_read(inp):
                root = root_value(inp.value)
                region = region_of(root) if root is not None else Region.interval(0, _HUGE)
                if region is not None and root is not None and root.offset != 0:
                    region = Region.interval(0, _HUGE)
            demand(inp, region)

        for node in sorted(self.universe.values(), key=lambda n: n.seq, reverse=True):
            nid = id(node)
            outs = objects.get(nid)
            seq = node.seq
            if nid in whole or nid in fills:
                live[nid] = node
                continue
            if nid in allocated:
                live[nid] = node
                if nid not in gen:
                    modes[nid] = ALLOC
                    allocs[nid] = allocated[nid]
                continue
            view_op, view_only, elementwise, copy = _op_flags(node.target) if node.kind == "op" else _NOT_OP
            if not node.writes and not view_op and nid not in forced and Input not in map(type, node.flat):
                # A factory (randn, empty, a constant) reads and writes
                # nothing: only its own outputs matter.
                if outs:
                    if any(demanded(value, seq)[2] for value in outs.values()):
                        live[nid] = node
                        part = _constant_part(node, outs, seq, demanded)
                        if part is not None and nid not in gen and allocatable(node, outs):
                            modes[nid] = ALLOC
                            allocs[nid] = dict(outs)
                            filled[nid] = part
                    elif nid not in gen and allocatable(node, outs):
                        live[nid] = node
                        modes[nid] = ALLOC
                        allocs[nid] = dict(outs)
                    else:
                        live[nid] = node
                elif nid in gen:
                    live[nid] = node
                    modes[nid] = GENERATOR
                continue
            if not node.writes and view_op:
                if outs or nid in forced:
                    live[nid] = node
                    for x in node.flat:
                        if type(x) is Input:
                            need(x)
                continue
            written = [node.flat[p] for p in node.writes]
            content = nid in forced
            hits = {}
            if node.writes and not node.reshapes:
                for p, w in zip(node.writes, written):
                    if type(w) is Input and not real_read(w):
                        region, k, found = demanded(w.value, seq)
                        if found or k is None:
                            content = True
                        hits[p] = (region, k, found)
            if outs and not node.writes:
                for value in outs.values():
                    if demanded(value, seq)[2]:
                        content = True
            if not (content or outs or nid in gen):
                continue
            live[nid] = node

            # How it runs.
            mode = RUN
            if nid in gen and not content and not outs:
                mode = GENERATOR
            elif outs and not content and nid not in gen and allocatable(node, outs):
                mode = ALLOC
            elif outs and content and nid not in gen and nid not in forced and not node.writes:
                # A factory of one constant whose bytes later writes mostly
                # cover: allocated, and filled where they are read only.
                part = _constant_part(node, outs, seq, demanded)
                if part is not None and allocatable(node, outs):
                    mode = ALLOC
                    filled[nid] = part
            elif loads_hide and copy and node.writes == (0,):
                found = direct_copy(node, self._real_read)
                if found is not None:
                    mode = DIRECT
                    directs[nid] = found
            if mode != RUN:
                modes[nid] = mode
            if mode == ALLOC:
                allocs[nid] = dict(outs)
                continue

            # What it does to the demands: writes first (they happen last), then reads.
            scratch = set()
            overwriting = overwrites(node) and (loads_hide or not is_load(node))
            for p, w in zip(node.writes, written):
                if type(w) is not Input:
                    continue
                if mode == GENERATOR and overwriting:
                    scratch.add(p)
                    continue
                need(w)
                if node.reshapes:
                    continue
                region, k, found = hits.get(p, (None, None, ()))
                if overwriting and k is not None and region is not None:
                    if node.kind == "load":
                        loads[nid] = load_parts(node, w.value, region, found)
                    elif mode == DIRECT:
                        found_parts = direct_parts(w.value, region, found)
                        if found_parts is not None:
                            directs[nid] = (*directs[nid], found_parts)
                    elif node.rng is not None and nid not in forced:
                        part = drawn_part(w.value, region, found)
                        if part is not None:
                            parts[nid] = part
                    kill(k, region, seq)
                else:
                    demand(w)
            if scratch:
                scratches[nid] = frozenset(scratch)
            if mode == DIRECT:
                continue
            partial = None
            if elementwise and nid not in forced and outs and 0 in outs:
                # Only the parts of the input that the demanded parts of the output come from.
                source = next((x for x in node.flat if type(x) is Input), None)
                found = demanded(outs[0], seq)[2]
                if source is not None and found:
                    partial = copied_parts(source.value, outs[0], found)
            first = True
            for p, x in enumerate(node.flat):
                if type(x) is not Input or p in node.writes:
                    continue
                if view_only and first:
                    need(x)
                elif partial is not None and first:
                    need(x)
                    for region in partial:
                        demand(x, region)
                else:
                    demand(x)
                first = False

        return {
            "live": live, "modes": modes, "alloc": allocs, "scratch": scratches, "loads": loads,
            "direct": directs, "parts": parts, "filled": filled, "order": sorted(live.values(), key=lambda n: n.seq),
        }

    # -- random draws needed only for the generator -----------------------------

    def drawing(self) -> list:
        """The live nodes that draw (whose generator states the replay needs)."""
        return [
            node for node in self.order
            if node.rng is not None and self.modes.get(id(node)) != ALLOC and node.rng[0]() is not None
        ]

    def _draws_needed(self) -> set:
        """Draws whose state a drawing node needs and that the scan left out."""
        drawing = self.drawing()
        known = self._known_before
        if known is not None and len(known[0]) == len(drawing) and all(id(n) in known[0] for n in drawing):
            before = known[1]
        else:
            before = self._draws_before(drawing, self.streams)
        new = set()
        for earlier in before:
            nid = id(earlier)
            if nid not in self.live or self.modes.get(nid) == ALLOC:
                new.add(nid)
        return new

    # -- modes ------------------------------------------------------------------

    # -- the interpreter's questions ------------------------------------------

    def mode(self, node) -> str:
        return self.modes.get(id(node), RUN)

    def reads(self, node) -> list:
        """The inputs a replay resolves for ``node``."""
        mode = self.modes.get(id(node))
        if mode is None:
            return [x for x in node.flat if type(x) is Input]
        if mode == ALLOC:
            return []
        if mode == DIRECT:
            return [node.flat[0]]
        skip = self.scratch.get(id(node), ())
        return [x for p, x in enumerate(node.flat) if type(x) is Input and p not in skip]
