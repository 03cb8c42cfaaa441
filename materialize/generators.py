"""Leaving the generators where eager construction would have left them.

Deferral draws nothing and writes no generator, so after ``deferred_init``
every generator is where it was.  Once a materialization knows the state a
stream ended in (it replayed the stream's last draw, maybe with a few
temporaries drawn after the last tensor: see ``Plan(finish=True)``), that
stream's generator is moved there, provided nothing moved it since
deferral: it still holds the state recording left it in, or the state the
record it continues ended in.  With ``device=``, the generator of the
target device is the one eager construction there would have advanced.
"""

from __future__ import annotations

from deferinit.rng import generator_of, get_state, same_state, set_state


def hand_over_generators(streams) -> None:
    """After a successful materialization: advance each generator whose final state
    the replay now knows, if nothing drew from it or set it since deferral.

    Example::

        >>> _ = torch.manual_seed(0); eager = torch.nn.Linear(2, 2); after = torch.rand(3)
        >>> _ = torch.manual_seed(0); m = deferred_init(torch.nn.Linear, 2, 2)
        >>> _ = materialize_module(m)   # calls hand_over_generators
        >>> torch.equal(torch.rand(3), after)
        True
    """
    for rs in _in_order(streams):
        end = rs.end_state()
        if end is None:
            continue
        gen = generator_of(rs.key)
        if gen is None:
            continue
        left = list(rs.left)
        if rs.prev is not None:
            start = rs.state_before(0)
            if start is not None:
                left.append(start)
        now = get_state(gen)
        if any(same_state(now, state) for state in left):
            set_state(gen, end)


def _in_order(streams) -> list:
    """Streams an earlier record's before those continuing it."""
    return sorted(streams, key=lambda rs: rs.nodes[0].seq if rs.nodes else -1)
