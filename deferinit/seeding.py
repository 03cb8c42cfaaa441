"""What user code does to the generators while a thread records.

Recording draws nothing, so the generators stand still; eager construction
would have advanced them.  User code inside a constructor that seeds or
reads a generator (``torch.manual_seed``, ``fork_rng``,
``torch.get_rng_state()`` kept in a buffer, a private generator cloned from
the global one) must see what it would have seen eagerly, and nothing
another thread can observe may change.  So torch's Python API for the
default generators is diverted in the recording thread (and only there):

* seeding (``torch.manual_seed``, ``torch.seed``, ``torch.cuda.manual_seed``
  and friends) and setting states (``set_rng_state``) become events of the
  record's streams, at the position they happen (:class:`deferinit.rng.Stream`);
  the real generators are not touched;
* reading (``get_rng_state``, ``initial_seed``) answers with the state eager
  construction would have reached at this point, replaying the draws made so
  far into scratch memory when it is not known yet;
* ``torch.default_generator`` (and ``torch._C.default_generator``,
  ``torch.random.default_generator``) is, in the recording thread, a
  stand-in whose methods do the same (``clone_state()`` gives a generator in
  eager's state), and which ops passed ``generator=torch.default_generator``
  treat as the default generator.

The recording thread's view of a default generator is its own: it starts
from the state the generator had when recording started, and moves only by
what this thread does.  Other threads draw from the real generator (their
draws do not reach this record), and the diverted functions do exactly what
they did there; setting a generator there also tells
:data:`deferinit.record.CHAINS` that the next record must not continue the
last one's stream, and :data:`deferinit.record.FOREIGN` which seed it
set, so that no recording thread takes it for its own.

Example::

    >>> _ = torch.manual_seed(0); eager = [torch.rand(2), torch.random.initial_seed()]
    >>> def build():
    ...     torch.rand(2)               # recorded, not drawn
    ...     return torch.get_rng_state()
    >>> _ = torch.manual_seed(0); state = deferred_init(build)
    >>> _ = torch.manual_seed(0); _ = torch.rand(2); torch.equal(state, torch.get_rng_state())
    True
"""

from __future__ import annotations

import functools
import types
import weakref

import torch

from deferinit.fake.bypass import no_python_dispatch
from deferinit.fake.device import normalize
from deferinit.fake.tensor import FakeTensor

from .patches import shared_patch
from .record import CHAINS, FOREIGN, Record, current_record
from .recorder import RECORDER
from .rng import (
    CPU, CPU_GENERATOR, SAME, SEED, SET, register_stand_in, scratch_generator, seed_of_state, seeded_state,
)

_C = torch._C.Generator


# -- answers for the recording thread ------------------------------------------------------


def state_now(record: Record, device: torch.device) -> torch.Tensor:
    """The state the default generator of ``device`` would have now, eagerly."""
    stream = record.stream(device)
    record.observe(device)
    k = len(stream.nodes)
    fact, _ = stream.state_before(k)
    if isinstance(fact, tuple):
        return seeded_state(device, fact[1])
    if fact is None:
        fact = RECORDER.generator_state(stream, k)
    return _copy(fact)


def _copy(state: torch.Tensor) -> torch.Tensor:
    """A real copy of a state (a real tensor, or a deferred one computed now)."""
    if isinstance(state, FakeTensor):
        return RECORDER.data_access("setting a generator state", state, _copy)
    with no_python_dispatch():  # a clone under the fake modes would be fake
        return state.clone()


def seed_now(record: Record, device: torch.device) -> int:
    """The ``initial_seed()`` the default generator of ``device`` would report now
    (draws do not change it: the nearest earlier fact answers)."""
    stream = record.stream(device)
    record.observe(device)
    k = len(stream.nodes)
    while True:
        event = stream.events.get(k)
        if event is not None:
            if event[1] == SEED:
                return event[2]
            if event[1] == SAME:
                k = event[2]
                continue
            return seed_of_state(device, event[2])
        if k > 0 and (k - 1) in stream.post:
            return seed_of_state(device, stream.post[k - 1])
        if k == 0:
            if stream.after is None:
                return _C.initial_seed(stream.generator)
            stream, k = stream.after, len(stream.after.nodes)
            continue
        k -= 1


def _check_seed(seed) -> int:
    # What eager accepts and how it fails otherwise, on a scratch generator.
    seed = int(seed)
    _C.manual_seed(scratch_generator("cpu"), seed)
    return seed


def _new_seed() -> int:
    return _C.seed(scratch_generator("cpu"))


def _set_state(record: Record, device: torch.device, state) -> None:
    if isinstance(state, torch.Tensor):
        state = _copy(state)
    if device.type == "cpu":
        _C.set_state(scratch_generator("cpu"), state)  # eager's checks, eager's errors
    stream = record.stream(device)
    stream.event(len(stream.nodes), SET, state)


def _cuda_device(device=None) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    return normalize(device if device is not None else "cuda")


# -- torch.default_generator in the recording thread ------------------------------------


class DefaultGeneratorStandIn(torch.Generator):
    """``torch.default_generator`` as the recording thread sees it (see the module
    docstring).  Outside its recording it acts on the real default generator."""

    def __new__(cls, record: Record):
        return super().__new__(cls)  # a CPU generator of its own, never drawn from

    def __init__(self, record: Record):
        self._record = weakref.ref(record)
        register_stand_in(self, CPU)

    def _recording(self):
        record = self._record()
        return record if record is not None and record is current_record() else None

    def manual_seed(self, seed):
        record = self._recording()
        if record is None:
            return _C.manual_seed(CPU_GENERATOR, seed)
        record.seed(_check_seed(seed), device=CPU)
        return self

    def seed(self):
        record = self._recording()
        if record is None:
            return _C.seed(CPU_GENERATOR)
        seed = _new_seed()
        record.seed(seed, device=CPU)
        return seed

    def initial_seed(self):
        record = self._recording()
        return seed_now(record, CPU) if record is not None else _C.initial_seed(CPU_GENERATOR)

    def get_state(self):
        record = self._recording()
        return state_now(record, CPU) if record is not None else _C.get_state(CPU_GENERATOR)

    def set_state(self, new_state):
        record = self._recording()
        if record is None:
            return _C.set_state(CPU_GENERATOR, new_state)
        _set_state(record, CPU, new_state)
        return self

    def clone_state(self):
        clone = torch.Generator()
        _C.set_state(clone, self.get_state())
        return clone


def _stand_in(record: Record) -> DefaultGeneratorStandIn:
    stand_in = _STAND_INS.get(id(record))
    if stand_in is None:
        stand_in = _STAND_INS[id(record)] = DefaultGeneratorStandIn(record)
        weakref.finalize(record, _STAND_INS.pop, id(record), None)
    return stand_in


_STAND_INS: dict[int, DefaultGeneratorStandIn] = {}


class _DivertedModule(types.ModuleType):
    """The class of ``torch``, ``torch._C`` and ``torch.random`` while a thread
    records: only ``default_generator`` differs, and only in recording threads."""

    @property
    def default_generator(self):
        record = current_record()
        if record is None:
            return vars(self).get("default_generator", CPU_GENERATOR)
        return _stand_in(record)

    @default_generator.setter
    def default_generator(self, value):
        vars(self)["default_generator"] = value


# -- the diverted functions -------------------------------------------------------------


def _diverted(original, virtual, sets: bool):
    """``original`` in other threads (telling CHAINS when it sets a generator), ``virtual``
    in the recording thread."""

    @functools.wraps(original)
    def call(*args, **kwargs):
        record = current_record()
        if record is None:
            if sets:
                CHAINS.bump()
                return FOREIGN.setting(original, *args, **kwargs)
            return original(*args, **kwargs)
        return virtual(record, original, *args, **kwargs)

    call.__deferinit_original__ = original
    return call


def _manual_seed(record, original, seed):
    record.seed(_check_seed(seed))
    return _stand_in(record)


def _seed(record, original):
    seed = _new_seed()
    record.seed(seed)
    return seed


def _initial_seed(record, original):
    return seed_now(record, CPU)


def _get_rng_state(record, original):
    return state_now(record, CPU)


def _set_rng_state(record, original, new_state):
    _set_state(record, CPU, new_state)


def _cuda_manual_seed(record, original, seed):
    record.seed(_check_seed(seed), device=_cuda_device())


def _cuda_manual_seed_all(record, original, seed):
    record.seed(_check_seed(seed), kind="cuda")


def _cuda_seed(record, original):
    record.seed(_new_seed(), device=_cuda_device())


def _cuda_seed_all(record, original):
    record.seed(_new_seed(), kind="cuda")


def _cuda_initial_seed(record, original):
    if not torch.cuda.is_available():
        return original()  # eager's error
    return seed_now(record, _cuda_device())


def _cuda_get_rng_state(record, original, device="cuda"):
    if not torch.cuda.is_available():
        return original(device)  # eager's error
    return state_now(record, _cuda_device(device))


def _cuda_get_rng_state_all(record, original):
    if not torch.cuda.is_available():
        return original()
    return [state_now(record, torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


def _cuda_set_rng_state(record, original, new_state, device="cuda"):
    _set_state(record, _cuda_device(device), new_state)


def _cuda_set_rng_state_all(record, original, new_states):
    for i, state in enumerate(new_states):
        _set_state(record, torch.device("cuda", i), state)


_RANDOM = {
    "manual_seed": (_manual_seed, True),
    "seed": (_seed, True),
    "initial_seed": (_initial_seed, False),
    "get_rng_state": (_get_rng_state, False),
    "set_rng_state": (_set_rng_state, True),
}
_CUDA = {
    "manual_seed": (_cuda_manual_seed, True),
    "manual_seed_all": (_cuda_manual_seed_all, True),
    "seed": (_cuda_seed, True),
    "seed_all": (_cuda_seed_all, True),
    "initial_seed": (_cuda_initial_seed, False),
    "get_rng_state": (_cuda_get_rng_state, False),
    "get_rng_state_all": (_cuda_get_rng_state_all, False),
    "set_rng_state": (_cuda_set_rng_state, True),
    "set_rng_state_all": (_cuda_set_rng_state_all, True),
}


def _replacements(table):
    def make(module):
        return {
            name: _diverted(getattr(module, name), virtual, sets)
            for name, (virtual, sets) in table.items()
            if getattr(module, name, None) is not None
        }

    return make


def _cuda_random():
    import torch.cuda.random

    return torch.cuda.random


FUNCTIONS = (
    shared_patch("generator api", "torch.random", lambda: torch.random, _replacements(_RANDOM)),
    shared_patch("generator api", "torch", lambda: torch, _replacements(_RANDOM)),
    shared_patch("generator api", "torch.cuda.random", _cuda_random, _replacements(_CUDA)),
    shared_patch("generator api", "torch.cuda", lambda: torch.cuda, _replacements(_CUDA)),
)
MODULE_CLASSES = tuple(
    shared_patch("module classes", name, module, lambda m: {"__class__": _DivertedModule})
    for name, module in (("torch", lambda: torch), ("torch._C", lambda: torch._C), ("torch.random", lambda: torch.random))
)


class installed:
    """Divert the generator API while this thread records (nesting and threads safe)."""

    def __enter__(self):
        for patch in FUNCTIONS + MODULE_CLASSES:
            patch.acquire(self)

    def __exit__(self, *exc):
        for patch in reversed(FUNCTIONS + MODULE_CLASSES):
            patch.release(self)


def hold_while_alive(record: Record) -> None:
    """Keep the functions diverted while ``record`` may be continued by the next one,
    so that a ``torch.manual_seed`` in between is noticed (see :data:`CHAINS`)."""
    holder = object()
    weakref.finalize(record, _release_functions, holder)
    for patch in FUNCTIONS:
        patch.acquire(holder)


def _release_functions(holder) -> None:
    for patch in reversed(FUNCTIONS):
        patch.release(holder)
