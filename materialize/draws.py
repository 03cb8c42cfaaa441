"""Random nodes in a replay: each draws from a private generator put in the state
its generator had eagerly.

A private generator of the same kind, in the same state, draws the same
numbers as the user's, so replay never touches a generator anyone else can
see: not the default generators, which other threads share, nor an explicit
one the user passed.  Operators that take no ``generator`` argument (and
have no overload that does, as ``randn`` has ``randn.generator``) are the
exception: they draw from the device's default generator, whose state is
put back when the replay ends.  :mod:`deferinit.materialize.generators` decides
afterwards whether a real generator is moved to where eager construction
left it.
"""

from __future__ import annotations

import torch

from deferinit.errors import DeviceUnavailableError
from deferinit.realdraws import with_generator
from deferinit.record import FOREIGN
from deferinit.rng import default_generator, generator_of, get_state, scratch_generator, set_state


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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for gen, state in self._borrowed.values():
            FOREIGN.set_state(gen, state)
        self._borrowed.clear()

    def call(self, node, args, kwargs):
        """Run random ``node`` with its arguments, from the state eager drew it from."""
        rs = self.streams[id(node.rng[0]())]
        index = rs.index[id(node)]
        gen = self._generator(rs)
        state = rs.state_before(index)
        if state is not None:
            set_state(gen, state)
        target, kwargs, takes = with_generator(node, kwargs, gen)
        if takes:
            out = target(*args, **kwargs)
        else:
            real = default_generator(rs.device)
            if id(real) not in self._borrowed:
                self._borrowed[id(real)] = (real, get_state(real))
            FOREIGN.set_state(real, get_state(gen))  # seen by no recording thread as its own
            out = target(*args, **kwargs)
            set_state(gen, get_state(real))
        rs.learn(index, get_state(gen))
        return out

    def _generator(self, rs) -> torch.Generator:
        if rs.generator is None:
            real = generator_of(rs.key)
            if real is None:
                raise DeviceUnavailableError(f"no random generator for {rs.key} in this process")
            gen = scratch_generator(rs.device)
            if rs.state_before(0) is None:
                # Recorded where this generator's state could not be read
                # (CUDA on a CPU-only build): start from its state now.
                set_state(gen, get_state(real))
            rs.generator = gen
        return rs.generator
