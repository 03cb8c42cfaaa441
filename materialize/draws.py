"""Random nodes in a replay: each draws from a private generator put in the state
its generator had eagerly.

Replay never touches a generator anyone else can see, except for
operators with no ``generator`` argument (nor an overload with one, as
``randn.generator``): they borrow the device's default generator, put back
when the replay ends.  On a CPU generator, a draw replayed only for the
state it leaves is jumped over, and one of which only a part (a shard's
rows) is needed draws only that part (:mod:`deferinit.random.jumps`); other
draws are generated, as on CUDA.
"""

from __future__ import annotations

import torch

from deferinit.fake.bypass import no_python_dispatch
from deferinit.fake.flat import unflatten
from deferinit.random.jumps import FALLBACKS, Cursor, checked, draw_part
from deferinit.random.realdraws import with_generator
from deferinit.random.record import FOREIGN
from deferinit.random.rng import SAME, default_generator, generator_of, get_state, scratch_generator, set_state
from deferinit.random.streams import continues, state_before

from .boxed import caller
from .errors import DeviceUnavailableError


class Draws:
    """Runs the random nodes of one replay.  Use as a context manager: generators
    borrowed for operators without a ``generator`` argument are put back on exit.

    Example (what the interpreter does for each random node)::

        >>> with Draws(plan.streams) as draws:
        ...     out = draws.call(node, args, kwargs)
    """

    def __init__(self, streams: dict):
        self.streams = streams
        self._borrowed: dict = {}
        # id(node.target) -> (what to call, whether it takes generator=): with_generator's answer.
        self._how: dict = {}
        # id(replay stream) -> [Cursor, index of the last draw skipped and not learned yet]
        self._cursors: dict = {}
        # Draws moved past only for the generator: jumped over (and their
        # words), or generated because their count is not known.
        self.stats = {"jumped": 0, "jumped_words": 0, "generated": 0}
        # (id(replay stream), draw) whose exact state after is looked up later
        # (an older state put back, a stream another continues): learned at once.
        self._looked_up = set()
        for rs in {id(rs): rs for rs in streams.values()}.values():
            for event in rs.events.values():
                if event[1] == SAME:
                    self._looked_up.add((id(rs), event[2]))
            if rs.after is not None and rs.after.nodes:
                self._looked_up.add((id(rs.after), len(rs.after.nodes) - 1))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        try:
            if exc_type is None:
                with no_python_dispatch():
                    for rs in {id(rs): rs for rs in self.streams.values()}.values():
                        self._learn(rs)  # those with a cursor
        finally:
            for gen, state in self._borrowed.values():
                FOREIGN.set_state(gen, state)
            self._borrowed.clear()

    def skip(self, node) -> bool:
        """Move the generator of random ``node`` past it without drawing (a draw
        replayed only for the state it leaves); False, having done nothing,
        when that cannot be done exactly here: the caller draws it."""
        rs = self.streams[id(node.rng[0]())]
        cursor = self._cursor(rs, node)
        if cursor is None:
            return False
        c = checked(node)
        if c is None:
            FALLBACKS[node.name] += 1
            self.stats["generated"] += 1
            return False
        index = rs.index[id(node)]
        self._start(rs, cursor, index)
        cursor.skip(c)
        self.stats["jumped"] += 1
        self.stats["jumped_words"] += c.words + 2 * c.normals
        self._passed(rs, index)
        return True

    def _passed(self, rs, index) -> None:
        """The cursor of ``rs`` stands after draw ``index``, paid or not."""
        self._cursors[id(rs)][1] = index
        if self._looked_up and (id(rs), index) in self._looked_up:
            self._learn(rs)

    def call(self, node, args, kwargs, part=None):
        """Run random ``node`` with its arguments, from the state eager drew it from;
        ``part=(lo, hi)``: only those elements of the tensor it fills in place
        are needed (the others are left as they are, where the kernel allows)."""
        rs = self.streams[id(node.rng[0]())]
        index = rs.index[id(node)]
        gen = rs.generator or self._generator(rs)
        entry = self._cursors.get(id(rs))
        cursor = entry[0] if entry is not None else self._cursor(rs, node)
        if cursor is not None:
            if not continues(rs, index):  # most draws follow the one before
                self._start(rs, cursor, index)
            if part is not None and self._call_part(rs, cursor, node, index, args, kwargs, part):
                return args[0]
            if cursor.owed or cursor.drop_normal:
                self._learn(rs)
        else:
            state = state_before(rs, index)
            if state is not None:
                set_state(gen, state)
        how = self._how.get(id(node.target))
        if how is None:
            target, _, takes = with_generator(node, {}, gen)
            how = self._how[id(node.target)] = (caller(target) if takes else target, takes)
        target, takes = how
        if takes:
            out = target(*args, **dict(kwargs, generator=gen))
        else:
            real = default_generator(rs.device)
            if id(real) not in self._borrowed:
                self._borrowed[id(real)] = (real, get_state(real))
            FOREIGN.set_state(real, get_state(gen))  # seen by no recording thread as its own
            out = target(*args, **kwargs)
            set_state(gen, get_state(real))
        if cursor is not None:
            # Cached when a later lookup or the replay's end asks (a state is
            # 5 KB: one per draw would cost a model of small tensors dearly).
            self._passed(rs, index)
        else:
            rs.learn(index, get_state(gen))
        return out

    def follow(self, node, flat=None, rs=None, index=None):
        """Draw random ``node`` with its recorded arguments (``flat``: with its
        tensor), right after the draw before it on its generator (the caller
        checked that nothing stands between): :meth:`call` less its
        questions, for runs of small tensors.  ``rs``, ``index``: its replay
        stream and position there, if the caller knows them."""
        args, kwargs = unflatten(node.flat if flat is None else flat, node.spec)
        if rs is None:
            rs = self.streams[id(node.rng[0]())]
        entry = self._cursors.get(id(rs))
        how = self._how.get(id(node.target))
        if entry is None or how is None or not how[1]:
            return self.call(node, args, kwargs)  # the first of its kind, or not on a CPU generator
        kwargs["generator"] = rs.generator
        out = how[0](*args, **kwargs)
        self._passed(rs, rs.index[id(node)] if index is None else index)
        return out

    def _call_part(self, rs, cursor, node, index, args, kwargs, part) -> bool:
        c = checked(node)
        if c is None or c.layout is None or node.writes != (0,) or not args:
            return False
        out = args[0]
        if not out.is_contiguous():
            return False
        target, kwargs, takes = with_generator(node, kwargs, cursor.generator)
        if not takes:
            return False
        rest = args[1:]
        if not draw_part(cursor, c, out.view(-1), part[0], part[1], lambda view: target(view, *rest, **kwargs)):
            return False
        self._passed(rs, index)
        return True

    def _start(self, rs, cursor, index) -> None:
        """The cursor stands right before draw ``index`` (from a known state, or
        after the draw before it)."""
        state = state_before(rs, index)
        if state is not None:
            cursor.reset(state)
            self._cursors[id(rs)][1] = None

    def _learn(self, rs) -> None:
        """Pay what the cursor of ``rs`` owes, and cache the state after the last draw skipped."""
        entry = self._cursors.get(id(rs))
        if entry is None:
            return
        cursor, last = entry
        if last is None and not cursor.owed and not cursor.drop_normal:
            return
        state = cursor.settle()
        if last is not None:
            rs.learn(last, state)
            entry[1] = None

    def _cursor(self, rs, node):
        """The cursor of ``rs`` when its generator is a CPU one (MT19937), else None."""
        entry = self._cursors.get(id(rs))
        if entry is not None:
            return entry[0]
        if rs.device.type != "cpu":
            return None
        gen = self._generator(rs)
        if gen.device.type != "cpu":
            return None
        self._cursors[id(rs)] = [Cursor(gen), None]
        return self._cursors[id(rs)][0]

    def _generator(self, rs) -> torch.Generator:
        if rs.generator is None:
            real = generator_of(rs.key)
            if real is None:
                raise DeviceUnavailableError(f"no random generator for {rs.key} in this process")
            gen = scratch_generator(rs.device)
            if state_before(rs, 0) is None:
                # Recorded where this generator's state could not be read
                # (CUDA on a CPU-only build): start from its state now.
                set_state(gen, get_state(real))
            rs.generator = gen
        return rs.generator
