"""What user code does to the generators while a thread records.

Eager construction would have advanced the generators; user code inside a
constructor that seeds or reads one (``torch.manual_seed``, ``fork_rng``,
``get_rng_state()`` kept in a buffer) must see what it would have seen
eagerly, and nothing another thread can observe may change.  So torch's
Python API for the default generators is diverted in the recording thread
only: seeds and set states become events of the record's streams
(:class:`deferinit.random.streams.Stream`), reads answer with eager's state
at this point, and ``torch.default_generator`` is a stand-in doing the
same.  Other threads call the originals, which also tell
:data:`deferinit.random.record.CHAINS`, ``LINEAGE`` and ``FOREIGN`` what
they set.  docs/design.md ("Random streams") has the whole story.

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
import sys
import threading
import time
import types
import weakref

import torch

from deferinit.fake.bypass import no_python_dispatch
from deferinit.fake.device import normalize
from deferinit.fake.locking import locked
from deferinit.fake.patch import release_all, shared_patch
from deferinit.fake.tensor import FakeTensor

from .record import CHAINS, FOREIGN, LINEAGE, Record, current_record
from ..recorder import RECORDER
from .rng import CPU, CPU_GENERATOR, SET, register_stand_in, scratch_generator
from .streams import seed_before

_C = torch._C.Generator


# -- answers for the recording thread ------------------------------------------------------


def state_now(record: Record, device: torch.device) -> torch.Tensor:
    """The state the default generator of ``device`` would have now, eagerly."""
    stream = record.stream(device)
    record.observe(device)
    return _copy(RECORDER.generator_state(stream, len(stream.nodes)))


def _copy(state: torch.Tensor) -> torch.Tensor:
    """A real copy of a state (a real tensor, or a deferred one computed now)."""
    if isinstance(state, FakeTensor):
        return RECORDER.data_access("setting a generator state", state, _copy)
    with no_python_dispatch():  # a clone under the fake modes would be fake
        return state.clone()


def seed_now(record: Record, device: torch.device) -> int:
    """The ``initial_seed()`` the default generator of ``device`` would report now."""
    stream = record.stream(device)
    record.observe(device)
    return seed_before(stream, len(stream.nodes))


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


def _diverted(original, virtual, sets: bool, told):
    """``original`` in other threads (telling CHAINS when it sets a generator, and
    LINEAGE what it did: ``told(result, *args, **kwargs)``), ``virtual`` in the
    recording thread.  One function under two names (``torch.manual_seed`` is
    ``torch.random.manual_seed``) stays one diverted function: code that asks
    whether they are the same (torch._dynamo's import) gets torch's answer."""
    key = (id(original), id(virtual))
    made = _DIVERTED.get(key)
    if made is not None and made[0] is original:
        return made[1]
    call = _divert(original, virtual, sets, told)
    _DIVERTED[key] = (original, call)
    return call


# (id(original), id(virtual)) -> (original, its diverted function).
_DIVERTED: dict = {}


def _divert(original, virtual, sets: bool, told):

    @functools.wraps(original)
    def call(*args, **kwargs):
        record = current_record()
        if record is None:
            if sets:
                CHAINS.bump()
                result = FOREIGN.setting(original, *args, **kwargs)
            else:
                result = original(*args, **kwargs)
            told(result, *args, **kwargs)
            if sets:
                _release_moot()
            return result
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


# -- what the calls of other threads (and of this one, outside recording) tell LINEAGE ----


def _all_reseeded(result, *args, **kwargs):
    LINEAGE.reseed()


def _nothing(result, *args, **kwargs):
    pass


def _cpu_read(result, *args, **kwargs):
    LINEAGE.read(CPU, result)


def _cpu_set(result, new_state=None, *args, **kwargs):
    LINEAGE.restored(CPU, kwargs.get("new_state", new_state))


def _cuda_key(device=None) -> torch.device:
    device = _cuda_device(device)
    if device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        device = torch.device("cuda", index)
    return device


def _cuda_reseeded(result, *args, **kwargs):
    LINEAGE.reseed(keys=(_cuda_key(),))


def _cuda_all_reseeded(result, *args, **kwargs):
    LINEAGE.reseed(kind="cuda")


def _cuda_read(result, device="cuda", *args, **kwargs):
    LINEAGE.read(_cuda_key(kwargs.get("device", device)), result)


def _cuda_read_all(result, *args, **kwargs):
    for i, state in enumerate(result or ()):
        LINEAGE.read(torch.device("cuda", i), state)


def _cuda_set(result, new_state=None, device="cuda", *args, **kwargs):
    LINEAGE.restored(_cuda_key(kwargs.get("device", device)), kwargs.get("new_state", new_state))


def _cuda_set_all(result, new_states=(), *args, **kwargs):
    for i, state in enumerate(kwargs.get("new_states", new_states)):
        LINEAGE.restored(torch.device("cuda", i), state)


# name -> (what the recording thread's call does, whether it sets, what other calls tell LINEAGE)
_RANDOM = {
    "manual_seed": (_manual_seed, True, _all_reseeded),
    "seed": (_seed, True, _all_reseeded),
    "initial_seed": (_initial_seed, False, _nothing),
    "get_rng_state": (_get_rng_state, False, _cpu_read),
    "set_rng_state": (_set_rng_state, True, _cpu_set),
}
_CUDA = {
    "manual_seed": (_cuda_manual_seed, True, _cuda_reseeded),
    "manual_seed_all": (_cuda_manual_seed_all, True, _cuda_all_reseeded),
    "seed": (_cuda_seed, True, _cuda_reseeded),
    "seed_all": (_cuda_seed_all, True, _cuda_all_reseeded),
    "initial_seed": (_cuda_initial_seed, False, _nothing),
    "get_rng_state": (_cuda_get_rng_state, False, _cuda_read),
    "get_rng_state_all": (_cuda_get_rng_state_all, False, _cuda_read_all),
    "set_rng_state": (_cuda_set_rng_state, True, _cuda_set),
    "set_rng_state_all": (_cuda_set_rng_state_all, True, _cuda_set_all),
}


def _replacements(table):
    def make(module):
        return {
            name: _diverted(getattr(module, name), virtual, sets, told)
            for name, (virtual, sets, told) in table.items()
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


def hold(holder) -> None:
    """Divert the generator API while this thread records, held as ``holder``
    (released by the recording's :class:`~deferinit.fake.guard.Entry`)."""
    for patch in FUNCTIONS + MODULE_CLASSES:
        patch.acquire(holder)


def hold_while_alive(record: Record) -> None:
    """Keep the functions diverted while ``record``'s draws on a default generator
    wait for their hand-over or may be continued by the next record, so that
    a seed or a state set in between is noticed (see :data:`LINEAGE`,
    :data:`CHAINS`): until that is moot (:func:`release_if_moot`) or the
    record dies."""
    if _held(record) is not None:
        return
    holder = _Holder()
    weakref.finalize(record, release_all, FUNCTIONS, holder)  # release_all: safe in a finalizer
    locked(_holders_lock, _add, record, holder)
    for patch in FUNCTIONS:
        patch.acquire(holder)


class _Holder:
    __slots__ = ("__weakref__",)


# id(record) -> (a weak reference to it, its holder).  Other threads' reseeds look
# through it (_release_moot) while a recording thread adds its record: changed and
# copied under a lock.  A dead record's entry stays until the next addition (its
# finalizer only lets go of the patches: see fake.patch.release_all).
_holders: dict = {}
_holders_lock = threading.Lock()


def _add(record: Record, holder) -> None:
    for key, (ref, _) in list(_holders.items()):
        if ref() is None:
            del _holders[key]
    _holders[id(record)] = (weakref.ref(record), holder)


def _held(record: Record):
    """The holder ``record`` holds the diversion as, or None."""
    held = _holders.get(id(record))
    return held[1] if held is not None and held[0]() is record else None


def release_if_moot(record: Record) -> None:
    """Stop diverting the functions for ``record`` once none of its default
    generators can be handed over or continued any more: each was reseeded
    since, and no state read since the record closed is alive.  A generator
    merely moved does not make it moot: a later seed may give it the very
    bytes the record left, and only the diversion tells the two apart.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 2, 2)
        >>> record = m.weight._record
        >>> _held(record) is not None
        True
        >>> _ = torch.manual_seed(0)    # what m drew is moot now
        >>> _held(record) is not None
        False
    """
    holder = _held(record)
    if holder is None:
        return
    for key, name in record.lineage.items():
        if LINEAGE.revivable(key, name) or LINEAGE.descends(key, name):
            return  # may still be handed over or continued there
    locked(_holders_lock, _holders.pop, id(record), None)
    release_all(FUNCTIONS, holder)


def _release_moot() -> None:
    for ref, _ in locked(_holders_lock, list, _holders.values()):
        record = ref()
        if record is not None:
            release_if_moot(record)


# -- seeding calls already under way when a record opens ---------------------------------


def wait_for_undiverted_calls(timeout: float = 2.0) -> bool:
    """Wait until no other thread is inside one of torch's own seeding functions
    (``torch.manual_seed``, ``set_rng_state``... undiverted), before a record
    reads its entry states; returns whether none was left under way after
    ``timeout`` seconds.

    A call looked up before the diversion went in, still running when the
    record opens, would seed the generator unlogged, and the record would
    take that seed for its own (:meth:`Record._observe`); every later call
    is diverted.  The only trace of a call in progress is its frame, in
    ``sys._current_frames()`` (see docs/design.md, "Random streams").

    Example::

        >>> wait_for_undiverted_calls()    # no other thread is seeding
        True
    """
    codes, deadline = _setter_codes(), None
    while _others_inside(codes):
        deadline = deadline if deadline is not None else time.monotonic() + timeout
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-4)  # lets the other thread finish its call
    return True


def _setter_codes() -> dict:
    """``{code: [functions]}``: the functions diverted here that set a generator as a
    lookup finds them (in place now, or what the diversion stands in for) and
    every function those wrap (``__wrapped__``: dynamo's import wraps
    ``torch.manual_seed``), by code object."""
    codes: dict = {}
    seen: set = set()
    for patch, table in zip(FUNCTIONS, (_RANDOM, _RANDOM, _CUDA, _CUDA)):
        saved = patch.originals()
        module = patch._module()
        for name, (_, sets, _) in table.items():
            if not sets:
                continue
            for fn in (getattr(module, name, None), saved.get(name)):
                while fn is not None and id(fn) not in seen:
                    seen.add(id(fn))
                    code = getattr(fn, "__code__", None)
                    if code is not None:
                        codes.setdefault(code, []).append(fn)
                    fn = getattr(fn, "__deferinit_original__", None) or getattr(fn, "__wrapped__", None)
    return codes


def _others_inside(codes) -> bool:
    """Whether a thread other than this one runs one of the functions of ``codes``
    (anywhere in its stack)."""
    frames = sys._current_frames()
    try:
        frames.pop(threading.get_ident(), None)
        for frame in frames.values():
            while frame is not None:
                functions = codes.get(frame.f_code)
                if functions is not None and any(_runs(frame, fn) for fn in functions):
                    return True
                frame = frame.f_back
        return False
    finally:
        # This thread's frame in the dict would make a cycle keeping alive every
        # local of its callers (the record being opened): none left behind.
        frames = frame = None


def _runs(frame, fn) -> bool:
    """Whether ``frame`` (of ``fn``'s code) is a call of ``fn``: a wrapper's code is
    shared by every function it wraps (dynamo's ``inner``), its closure tells
    them apart."""
    if not fn.__closure__:
        return True
    local = frame.f_locals  # a frame's free variables are among its locals
    try:
        return all(
            local.get(name, _runs) is cell.cell_contents
            for name, cell in zip(fn.__code__.co_freevars, fn.__closure__)
        )
    except ValueError:  # an empty cell
        return False
