"""A record: what one ``deferred_init`` call needs to replay its tensors exactly.

The graph itself lives in nodes and values reachable from the fakes.  The
record keeps what is *not* reachable that way: the random nodes of each
generator stream, in order (a random temporary that nothing keeps still
advanced the generator eagerly, so it must be replayed), and the generator
states at entry and exit.  Fakes hold their record; the graph never does.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from .rng import Stream, generator_of, get_state, gettable

_ids = itertools.count(1)


class Record:
    """The session state of one ``deferred_init`` call (nested calls share it)."""

    __slots__ = ("id", "label", "streams", "entry", "exit", "merged", "parents", "open", "__weakref__")

    def __init__(self, label: str = ""):
        self.id = next(_ids)
        self.label = label
        self.streams: dict = {}
        # Generator states when recording started / stopped, by stream key.
        self.entry: dict = {torch.device("cpu"): get_state(torch.default_generator)}
        self.exit: dict = {}
        # States learned while replaying streams merged by a device remap.
        self.merged: dict = {}
        # Records whose tensors fed ops of this one: kept alive with it.
        self.parents: set = set()
        self.open = True

    def add_random(self, node, key) -> None:
        """Append random ``node`` to the stream of ``key``, remembering the state if knowable."""
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = Stream(key, self)
            stream.ref = weakref.ref(stream)
            stream.generator = generator_of(key) if gettable(key) else None
        gen = stream.generator
        index = stream.append(node, get_state(gen) if gen is not None else None)
        node.rng = (stream.ref, index)

    def close(self) -> None:
        """Recording stopped: remember the states the generators were left in."""
        self.open = False
        for key in {torch.device("cpu"), *self.streams}:
            if gettable(key):
                self.exit[key] = get_state(generator_of(key))

    def __repr__(self) -> str:
        return f"<Record {self.id} {self.label}>"


