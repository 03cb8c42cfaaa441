"""Leaving the generators where eager construction would have left them.

Deferral draws nothing, so after ``deferred_init`` the generators are where
they were before it.  Once a complete materialization replayed every draw,
each generator that nothing has drawn from since is advanced to the state
eager construction would have left it in.
"""

from __future__ import annotations

from deferinit.rng import generator_of, get_state, same_state, set_state


def streams_to_finish(records) -> list:
    """The last draw of each of the records' streams whose final state is unknown,
    when the generator is still where deferral left it (so it can be advanced)."""
    nodes = []
    for record in records:
        for key, stream in record.streams.items():
            end = end_of(stream)
            if not stream.nodes or end in stream.known:
                continue
            exit_state = record.exit.get(key)
            gen = generator_of(key) if exit_state is not None else None
            if gen is None or not same_state(get_state(gen), exit_state):
                continue
            nodes.append(stream.nodes[end - 1])
    return nodes


def end_of(stream) -> int:
    """The position whose state eager construction left the generator in (the
    end of the stream, or an earlier one put back after the last draw)."""
    end = len(stream.nodes)
    while end in stream.same:
        end = stream.same[end]
    return end


def hand_over_generators(records) -> None:
    """Leave each generator where eager construction would have, if nothing drew
    from it since deferral and the replay now knows that state."""
    for record in records:
        for key, stream in record.streams.items():
            post = stream.known.get(end_of(stream))
            exit_state = record.exit.get(key)
            if post is None or exit_state is None:
                continue
            gen = generator_of(key)
            if gen is not None and same_state(get_state(gen), exit_state):
                set_state(gen, post)
