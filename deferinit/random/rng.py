"""Random number generators: which one an op draws from, and reading, setting and seeding their states.

Recording draws nothing: each random node joins the *stream* of the generator
it would have drawn from (:mod:`deferinit.random.streams`): the default generator of
its device, or an explicit ``torch.Generator``.  How user code is observed
without ever writing to a shared generator is in :mod:`deferinit.random.seeding`.
"""

from __future__ import annotations

import itertools
import random
import weakref

import torch

from deferinit.fake.device import exists, normalize

# Tags are 64-bit values unlikely to be anyone's seed.
_tags = itertools.count(random.SystemRandom().getrandbits(40) << 23)

OBSERVED, SET, SEED, SAME = "observed", "set", "seed", "same"

CPU = torch.device("cpu")
# The real default CPU generator, taken before anything is diverted: while a
# thread records, torch.default_generator and torch._C.default_generator are
# that thread's stand-in (deferinit.random.seeding).
CPU_GENERATOR = torch._C.default_generator


def default_generator(device: torch.device) -> torch.Generator | None:
    """The default generator of ``device``; None where the device does not exist."""
    device = normalize(device)
    if device.type == "cpu":
        return CPU_GENERATOR
    if not exists(device):
        return None
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if generators is None:
        return None
    if device.type == "cuda":
        torch.cuda.init()
    return generators[device.index or 0]


# Generators standing for a device's default generator while a thread records
# (deferinit.random.seeding's view of torch.default_generator): C++ identity -> device.
_STAND_INS: dict[int, torch.device] = {}


def register_stand_in(generator: torch.Generator, device: torch.device) -> None:
    """``generator`` stands for ``device``'s default generator, for as long as it lives
    (its C++ address may be another generator's afterwards)."""
    cdata = generator._cdata
    _STAND_INS[cdata] = device
    weakref.finalize(generator, _STAND_INS.pop, cdata, None)


class GeneratorKey:
    """Stream key of an explicit generator that is not a device's default one.

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


def initialized_generators():
    """``(key, generator)`` for the default generators that exist now without
    initializing a backend (CPU, and CUDA's once CUDA is initialized)."""
    yield CPU, CPU_GENERATOR
    if torch.cuda.is_initialized():
        for i, gen in enumerate(torch.cuda.default_generators):
            yield torch.device("cuda", i), gen


def key_of_generator(generator: torch.Generator):
    """The stream key of ``generator``: its device when it is that device's default
    generator (or stands for it), else the generator itself."""
    device = _STAND_INS.get(generator._cdata)
    if device is not None:
        return device
    device = normalize(generator.device)
    if gettable(device):
        default = default_generator(device)
        if default is not None and default._cdata == generator._cdata:
            return device
    return GeneratorKey(generator)


def stream_key(func_kwargs: dict, device: torch.device):
    """The stream a random op draws from: its explicit generator, else its device.

    Example::

        >>> stream_key({"generator": torch.default_generator}, torch.device("cpu"))
        device(type='cpu')
    """
    gen = func_kwargs.get("generator") if func_kwargs else None
    if gen is not None:
        return key_of_generator(gen)
    return normalize(device)


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
    # get_state allocates through the dispatcher: keep the dispatch modes out of it.
    with torch._C._DisableTorchDispatch():
        return torch._C.Generator.get_state(gen)


def set_state(gen: torch.Generator, state: torch.Tensor) -> None:
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        torch._C.Generator.set_state(gen, state)


def fingerprint(state: torch.Tensor) -> bytes:
    """The bytes of a generator state, for comparisons (no user mode sees the read)."""
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return state.numpy().tobytes()


#: ``current_seed(gen)``: the seed ``gen`` was last given (manual_seed, seed, or a
#: state set): a C call without allocation, cheap enough for every recorded
#: draw.  Draws do not change it, so another thread's draws go unnoticed.
current_seed = torch._C.Generator.initial_seed


def same_state(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return fingerprint(a) == fingerprint(b)


def scratch_generator(device) -> torch.Generator:
    """A private generator of ``device``'s kind, for computing states without
    touching anyone's generator."""
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return torch.Generator(device=device)


def seeded_state(device, seed: int) -> torch.Tensor:
    """The state ``manual_seed(seed)`` gives a generator of ``device``.

    Example::

        >>> a = seeded_state("cpu", 3); _ = torch.manual_seed(3)
        >>> torch.equal(a, torch.get_rng_state())
        True
    """
    gen = scratch_generator(device)
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        torch._C.Generator.manual_seed(gen, seed)
    return get_state(gen)


def seed_of_state(device, state: torch.Tensor) -> int:
    """The ``initial_seed()`` of a generator of ``device`` in ``state``."""
    gen = scratch_generator(device)
    set_state(gen, state)
    return torch._C.Generator.initial_seed(gen)


def new_tag() -> int:
    return next(_tags)
