"""Random number generators: which one an op draws from, and their states.

Recording draws nothing.  Each random node is appended to the *stream* of
the generator it would have drawn from (the default generator of its
device, or an explicit ``torch.Generator``), and replay rebuilds the state
before any draw from the nearest known state, re-running the draws in
between (see :mod:`deferinit.replay`).

What the record must know is where user code *set* a generator between two
draws (``torch.manual_seed(0)`` inside a constructor, even to the seed it
already had; ``fork_rng`` putting an older state back).  Since recording
does not advance the generator, comparing states cannot tell.  So after
each recorded draw the generator is *marked*: seeded with a unique tag
standing for "after draw k of this stream" (nothing draws from it while
recording: draws are recorded, not made).  At the next draw its initial
seed says where the state came from: still the mark of the previous draw (a
plain continuation), the mark of an earlier position (an old state put
back: the draw starts from that position's state), or no mark at all (the
user set a new state: it is read and known exactly).  When recording ends
the generator gets back its last real state, unless the user set one after
the last draw, which eager construction would have kept too.
"""

from __future__ import annotations

import itertools
import random
import weakref

import torch

from fake.device import exists, normalize

# Tags are 64-bit values unlikely to be anyone's seed.
_tags = itertools.count(random.SystemRandom().getrandbits(40) << 23)


def default_generator(device: torch.device) -> torch.Generator | None:
    """The default generator of ``device``; None where the device does not exist."""
    device = normalize(device)
    if device.type == "cpu":
        return torch.default_generator
    if not exists(device):
        return None
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if generators is None:
        return None
    if device.type == "cuda":
        torch.cuda.init()
    return generators[device.index or 0]


class GeneratorKey:
    """Stream key of an explicit generator.

    The dispatcher hands operators a new Python object for a generator the
    user passed, so generators are told apart by their C++ object.
    """

    __slots__ = ("generator", "cdata")

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self.cdata = generator._cdata

    def __hash__(self) -> int:
        return hash(self.cdata)

    def __eq__(self, other) -> bool:
        return type(other) is GeneratorKey and other.cdata == self.cdata

    def __repr__(self) -> str:
        return f"GeneratorKey({self.generator.device})"


def generator_of(key) -> torch.Generator | None:
    """The generator behind a stream key (an explicit generator, or a device)."""
    if type(key) is GeneratorKey:
        return key.generator
    return default_generator(key)


def gettable(key) -> bool:
    """Whether the state behind a stream key can be read without touching a missing backend."""
    if type(key) is not torch.device:
        return True
    return key.type == "cpu" or exists(key)


def get_state(gen: torch.Generator) -> torch.Tensor:
    # get_state allocates through the dispatcher: keep the modes out of it.
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return gen.get_state()


def set_state(gen: torch.Generator, state: torch.Tensor) -> None:
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        gen.set_state(state)


def fingerprint(state: torch.Tensor) -> bytes:
    """The bytes of a generator state, for comparisons."""
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return state.numpy().tobytes()


def same_state(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return fingerprint(a) == fingerprint(b)


class Stream:
    """The random nodes of one record that draw from one generator, in order.

    ``known[i]`` is the generator state before ``nodes[i]`` where it is
    known (``known[len(nodes)]`` is the state after the last draw);
    ``same[i] = j`` says the state before ``nodes[i]`` is the one before
    ``nodes[j]`` (an older state put back).  States learned while recording
    are exact; replay caches every state it passes in ``known``.
    """

    __slots__ = ("key", "nodes", "known", "same", "base", "record", "ref", "generator", "__weakref__")

    def __init__(self, key, record=None):
        self.key = key
        # Weak: the record owns its streams.
        self.record = weakref.ref(record) if record is not None else None
        self.ref = weakref.ref(self)  # shared by the stream's nodes
        self.generator = generator_of(key) if gettable(key) else None
        self.nodes: list = []
        self.known: dict[int, torch.Tensor] = {}
        self.same: dict[int, int] = {}
        # The last real (unmarked) state seen: what the generator gets back.
        self.base = None

    def learn(self, index: int, state: torch.Tensor) -> None:
        """Cache the state before position ``index`` (replay calls this)."""
        if index not in self.known and index not in self.same:
            self.known[index] = state


def stream_key(func_kwargs: dict, device: torch.device):
    """The stream a random op draws from: its explicit generator, else its device."""
    gen = func_kwargs.get("generator") if func_kwargs else None
    if gen is not None:
        return GeneratorKey(gen)
    return normalize(device)


def new_tag() -> int:
    return next(_tags)
