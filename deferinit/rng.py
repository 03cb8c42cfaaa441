"""Random number generators: which one an op draws from, and their states.

Recording draws nothing.  Instead each random node is appended to the
*stream* of the generator it would have drawn from (the default generator of
its device, or an explicit ``torch.Generator``), and the generator's state is
remembered where it is known: at the first draw of the record, and again
wherever user code reseeded between two draws.  Replay rebuilds the state
before any draw from the nearest known state, re-running the draws in
between (see :mod:`deferinit.replay`), and caches every state it passes.
"""

from __future__ import annotations

import weakref

import torch

from fake.device import exists, normalize


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


def generator_of(key) -> torch.Generator | None:
    """The generator behind a stream key (an explicit generator, or a device)."""
    if isinstance(key, torch.Generator):
        return key
    return default_generator(key)


def gettable(key) -> bool:
    """Whether the state behind a stream key can be read without touching a missing backend."""
    if isinstance(key, torch.Generator):
        return True
    return key.type == "cpu" or exists(key)


def get_state(gen: torch.Generator) -> torch.Tensor:
    # get_state allocates through the dispatcher: keep the modes out of it.
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return gen.get_state()


def fingerprint(state: torch.Tensor) -> bytes:
    """The bytes of a generator state, for cheap comparisons."""
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return state.numpy().tobytes()


def set_state(gen: torch.Generator, state: torch.Tensor) -> None:
    from fake.dispatch import no_python_dispatch

    with no_python_dispatch():
        gen.set_state(state)


def same_state(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return fingerprint(a) == fingerprint(b)


class Stream:
    """The random nodes of one record that draw from one generator, in order.

    ``known[i]`` is the generator state before ``nodes[i]`` where it is known
    (``known[len(nodes)]`` is the state after the last draw); ``last_seen``
    is the fingerprint of the state at the latest draw recorded.  States
    learned at record time are exact; replay adds the ones it passes.
    """

    __slots__ = ("key", "nodes", "known", "last_seen", "record", "ref", "generator", "__weakref__")

    def __init__(self, key, record=None):
        self.key = key
        # Weak: the record owns its streams.
        self.record = weakref.ref(record) if record is not None else None
        self.ref = None  # a weak reference to this stream, shared by its nodes
        self.generator = None  # the generator whose states are recorded
        self.nodes: list = []
        self.known: dict[int, torch.Tensor] = {}
        self.last_seen = None

    def append(self, node, state: torch.Tensor | None) -> int:
        """Add a random node; ``state`` is the generator's state now (or None if unknowable)."""
        index = len(self.nodes)
        seen = fingerprint(state) if state is not None else None
        if seen is not None and (index == 0 or seen != self.last_seen):
            # First draw, or the user reseeded since the previous draw.
            self.known[index] = state
        self.last_seen = seen
        self.nodes.append(node)
        return index


def stream_key(func_kwargs: dict, device: torch.device):
    """The stream a random op draws from: its explicit generator, else its device."""
    gen = func_kwargs.get("generator") if func_kwargs else None
    if isinstance(gen, torch.Generator):
        return gen
    return normalize(device)
