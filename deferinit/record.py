"""A record: what one ``deferred_init`` call needs to replay its tensors exactly.

The graph itself lives in nodes and values reachable from the fakes.  The
record keeps what is *not* reachable that way: the random nodes of each
generator stream, in order (a random temporary that nothing keeps still
advanced the generator eagerly, so it must be replayed), and the generator
states at entry and exit.  Fakes hold their record; the graph never does.
"""

from __future__ import annotations

import itertools
import threading

import torch

from .graph import next_seq
from .rng import Stream, generator_of, get_state, gettable, new_tag, set_state

_ids = itertools.count(1)
_CPU = torch.device("cpu")


class Record:
    """The session state of one ``deferred_init`` call (nested calls share it)."""

    __slots__ = ("id", "label", "base", "streams", "entry", "exit", "merged", "parents", "open", "markers", "__weakref__")

    def __init__(self, label: str = ""):
        self.id = next(_ids)
        self.label = label
        # Printed node numbers count from here (deferinit.view).
        self.base = next_seq()
        self.streams: dict = {}
        # Generator states when recording started / stopped, by stream key.
        self.entry: dict = {_CPU: get_state(torch.default_generator)}
        self.exit: dict = {}
        # States learned while replaying streams merged by a device remap.
        self.merged: dict = {}
        # Records whose tensors fed ops of this one: kept alive with it.
        self.parents: set = set()
        self.open = True
        # Tag of a marked generator state -> (stream, position it stands for).
        self.markers: dict = {}

    def add_random(self, node, key) -> None:
        """Append random ``node`` to the stream of ``key`` (see :mod:`deferinit.rng`)."""
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = Stream(key, self)
        index = len(stream.nodes)
        stream.nodes.append(node)
        node.rng = (stream.ref, index)
        gen = stream.generator
        if gen is None or not self.open:
            # After deferred_init returned: the draw continues the stream,
            # as it would right after eager construction.
            if index == 0 and key in self.exit:
                # No draw while recording: the stream starts where
                # construction left the generator, not where it is now.
                stream.known[0] = self.exit[key]
            return
        mark = self.markers.get(gen.initial_seed())
        if mark is not None and mark[0] is stream:
            if mark[1] != index:
                stream.same[index] = mark[1]
        else:
            # First draw, or user code set the generator since the last one.
            state = get_state(gen)
            stream.known[index] = state
            stream.base = state
        tag = new_tag()
        gen.manual_seed(tag)
        self.markers[tag] = (stream, index + 1)

    def close(self) -> None:
        """Recording stopped: unmark the generators and remember their states."""
        self.open = False
        for key, stream in self.streams.items():
            gen = stream.generator
            if gen is not None and stream.base is not None:
                mark = self.markers.get(gen.initial_seed())
                if mark is not None and mark[0] is stream:
                    set_state(gen, stream.base)
                    if mark[1] != len(stream.nodes):
                        # An older state put back after the last draw (fork_rng).
                        stream.known.pop(len(stream.nodes), None)
                        stream.same[len(stream.nodes)] = mark[1]
                else:
                    # The user set the generator after the last draw
                    # (manual_seed, fork_rng): eager construction ends there,
                    # whatever a replay for .item() learned about that position.
                    stream.known[len(stream.nodes)] = get_state(gen)
        self.markers.clear()
        for key in {_CPU, *self.streams}:
            if gettable(key):
                self.exit[key] = get_state(generator_of(key))

    def __repr__(self) -> str:
        return f"<Record {self.id} {self.label}>"


class _Local(threading.local):
    def __init__(self) -> None:
        self.records: list[Record] = []


_local = _Local()


def current_record() -> Record | None:
    """The record of the innermost ``deferred_init`` running in this thread."""
    records = _local.records
    return records[-1] if records else None


def open_records() -> list[Record]:
    """The records of the ``deferred_init`` calls running in this thread, innermost last."""
    return _local.records
