"""Real random draws after a deferral whose own draws on that generator are still pending.

A real draw after ``deferred()`` (``get_peft_model`` on a deferred base, a
new head, ``torch.randn`` for an input) starts from the state *before* the
model's draws, where eagerly it came after them: it and every later draw
differ from eager.  Generating the model's numbers then would take minutes,
so a :class:`~deferinit.errors.PendingDrawsWarning` says so instead, once
per deferral, naming the op, the modules being built and the deferral.

Only while a closed record may still warn are the ``torch`` functions and
``Tensor`` methods of every ATen op with a ``generator`` argument diverted
to a check: the draw is pending while the generator holds the state
recording left it in and no seed was set since.  Random kernels called
from C++ (``F.dropout``) are not seen.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref

import torch

from deferinit.fake.compiling import not_inlined
from deferinit.fake.locking import locked
from deferinit.fake.patch import release_all, shared_patch
from deferinit.fake.state import in_fake_mode
from deferinit.fake.tensor import FakeTensor

from ..errors import PendingDrawsWarning
from .record import CHAINS, current_record
from .rng import default_generator, fingerprint, get_state
from ..where import constructing

# Re-entrant: a record's finalizer (its hold's release) may run from the
# cyclic collector while this thread holds the lock.
_lock = threading.RLock()
# Watched record -> its _Hold; only records that may still warn (see _retire).
_watched: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CPU = torch.device("cpu")


class _Hold:
    """A watched record's hold of the diversions: the seeding epoch when it
    closed, the devices whose draws may still be pending, the draws found
    pending and not finished yet (``busy``: the record is not retired under
    them, so that their warning is not lost to another thread that sees the
    generator they moved).  It holds the patches under its own name: released
    when it can no longer warn, or when it dies (idempotent)."""

    __slots__ = ("epoch", "devices", "busy", "__weakref__")

    def __init__(self, epoch, devices):
        self.epoch = epoch
        self.devices = devices
        self.busy = 0

    def release(self) -> None:
        release_all(PATCHES, self)


def watch(record) -> None:
    """Check real draws against ``record`` (closed) while it may warn, if it drew
    from a default generator.

    Example::

        >>> from deferinit import deferred
        >>> with deferred() as record:
        ...     m = torch.nn.Linear(2, 2)
        >>> record in _watched       # deferred() watched it when it closed
        True
    """
    devices = {
        k for k, s in record.streams.items() if type(k) is torch.device and s.nodes and record.exit.get(k) is not None
    }
    if not devices:
        return
    locked(_lock, _watch, record, devices)


def _watch(record, devices) -> None:
    if record in _watched:
        return
    # Held before any thread can find (and retire) the record: the count pairs.
    # The release is registered before the hold, so that an interrupt between
    # the two leaves nothing held for good (a release of nothing is a no-op).
    hold = _watched[record] = _Hold(_epoch(), devices)
    weakref.finalize(record, release_all, PATCHES, hold)  # release_all: safe in a finalizer
    for patch in PATCHES:
        patch.acquire(hold)


def _retire(record, hold) -> None:
    """Stop watching ``record``, which can no longer warn, unless a draw found
    it pending and has not warned yet (that draw retires it)."""
    if locked(_lock, _unwatch, record, hold, lambda: not hold.busy):
        hold.release()


def _unwatch(record, hold, ready) -> bool:
    """Stop watching ``record`` if ``hold`` is its and ``ready()``; whether it did."""
    if _watched.get(record) is not hold or not ready():
        return False
    del _watched[record]
    return True


def _epoch():
    # Bumped by every torch.manual_seed & co. while such a record lives
    # (deferinit.random.seeding keeps them diverted for it).
    return getattr(CHAINS, "_epoch", None)


def _pending(device: torch.device):
    """``(record, hold)`` for a watched record whose draws on ``device``'s default
    generator are pending (counted busy until :func:`_finish`), or None.

    A record that can never be pending again is retired on the way, so that
    the diversions cost nothing once no record can warn: a seed was set
    since it closed (the epoch moved), or the generator no longer holds the
    state it left (a materialization handed the generator over, or a draw
    moved it; torch.set_rng_state back to that state moves the epoch too)."""
    entries = locked(_lock, lambda: [(r, h) for r, h in _watched.items() if device in h.devices])
    if not entries:
        return None
    epoch = _epoch()
    now = None
    for record, hold in entries:
        if hold.epoch != epoch:
            _retire(record, hold)
            continue
        if now is None:
            gen = default_generator(device)
            if gen is None:
                return None
            now = fingerprint(get_state(gen))
        if now == fingerprint(record.exit[device]):
            if locked(_lock, _busy, record, hold):
                return record, hold
            continue
        if locked(_lock, _left, hold, device):
            _retire(record, hold)
    return None


def _busy(record, hold) -> bool:
    if _watched.get(record) is not hold:
        return False
    hold.busy += 1  # until _finish: the draw is under way
    return True


def _left(hold, device) -> bool:
    """``device``'s draws of ``hold``'s record can no longer be pending; whether none can."""
    hold.devices.discard(device)
    return not hold.devices


def _device_of(args, kwargs) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    if not torch._C._len_torch_function_stack():
        return _CPU  # no torch.device(...) context, no set_default_device
    return torch.get_default_device()


def _pending_draw(args, kwargs):
    """``(record, hold, device)`` when this call draws from a default generator
    whose deferred draws are pending, else None."""
    generator = kwargs.get("generator")
    if generator is not None and generator is not default_generator(generator.device):
        return None  # a generator of the user's own: no deferral drew from it
    if any(isinstance(a, FakeTensor) for a in (*args, *kwargs.values())):
        return None
    if generator is not None:
        device = generator.device
    else:
        device = _device_of(args, kwargs)
        if device.type != "cpu" and default_generator(device) is None:
            return None  # a device this process does not have: eager raises next
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _pending(device)
    return None if found is None else (*found, device)


def _check(args, kwargs):
    """``(record, hold, device)`` for a real draw while that record's draws are pending."""
    if current_record() is not None or in_fake_mode() or _pytorch_fake(args, kwargs):
        return None  # recorded, or fakes (ours or PyTorch's): nothing is drawn for real here
    try:
        return _pending_draw(args, kwargs)
    except Exception:  # noqa: BLE001 - arguments eager refuses: its own error comes next
        return None


_FAKE_MODE_KEY = torch._C._TorchDispatchModeKey.FAKE


def _pytorch_fake(args, kwargs) -> bool:
    """Whether PyTorch's own FakeTensorMode answers this call (active, or one of its
    fakes is an argument): it draws from no generator."""
    if torch._C._get_dispatch_mode(_FAKE_MODE_KEY) is not None:
        return True
    from torch._subclasses.fake_tensor import FakeTensor as TorchFakeTensor

    return any(isinstance(a, TorchFakeTensor) for a in (*args, *kwargs.values()))


def _finish(record, hold, drew: bool) -> bool:
    """A draw found ``record`` pending is over: True if it drew and is the first
    to (it warns, and the record is retired)."""
    # Not drawn (eager raised): retired only if another thread found the
    # generator moved meanwhile and left the record to this call.
    retire = locked(_lock, _done, record, hold, lambda: drew or not hold.devices)
    if retire:
        hold.release()
    return retire and drew


def _done(record, hold, ready) -> bool:
    hold.busy -= 1
    return _unwatch(record, hold, ready)


def _warn(name: str, record, hold, device) -> None:
    if not _finish(record, hold, True):
        return  # warned already (once per deferral)
    n = len(record.streams[device].nodes)
    building = constructing()
    where = "" if building.startswith("(") else f" (constructing {building})"
    warnings.warn(
        f"{name} draws from the default {device} generator for real{where} while "
        f"{n} random draw(s) of {record.label} from that generator "
        "are still deferred. Eagerly those draws come first, so this draw and every later "
        "one from that generator differ from eager construction, and materialization "
        "cannot leave the generator where eager construction would. Make these tensors "
        "inside the deferral too (with deferred(): get_peft_model(model, config)), or "
        "materialize first (materialize_module(model)). Shown once per deferral.",
        PendingDrawsWarning,
        stacklevel=3,
    )


def _checking(name: str, original):
    @functools.wraps(original)
    def draw(*args, **kwargs):
        found = _check(args, kwargs)
        if found is None:
            return original(*args, **kwargs)
        try:
            out = original(*args, **kwargs)
        except BaseException:  # eager's error: nothing was drawn, the record may still warn
            _finish(*found[:2], False)
            raise
        _warn(name, *found)
        return out

    # What fake.mode's function mode calls instead (PyTorch hands Tensor
    # methods to torch-function modes by their name on torch.Tensor).
    draw.__deferinit_stands_for__ = original
    # Pickled by reference as what it stands for (torch.<name>, torch.Tensor.<name>), as the builtin is.
    draw.__module__, draw.__qualname__ = "torch", name.removeprefix("torch.")
    return not_inlined(draw)


_names: dict = {}


def random_ops() -> tuple:
    """``(torch functions, Tensor methods)``: the names of ATen ops that take a ``generator``.

    Example::

        >>> functions, methods = random_ops()
        >>> "randn" in functions, "uniform_" in methods
        (True, True)
    """
    if not _names:
        # Asked name by name: torch._C._jit_get_all_schemas() would parse every
        # operator's schema for good, 5 MiB of resident memory for the process.
        def takes_generator(name):
            return any(
                a.name == "generator" for s in torch._C._jit_get_schemas_for_operator("aten::" + name) for a in s.arguments
            )

        def named(owner):
            return tuple(sorted(
                n for n in dir(owner) if not n.startswith("__") and takes_generator(n) and callable(getattr(owner, n, None))
            ))

        _names["functions"] = named(torch)
        _names["methods"] = named(torch.Tensor)
    return _names["functions"], _names["methods"]


def _replacements(which: str, prefix: str):
    def make(owner) -> dict:
        names = random_ops()[0 if which == "functions" else 1]
        return {name: _checking(prefix + name, getattr(owner, name)) for name in names}

    return make


PATCHES = (
    shared_patch("pending draws", "torch", lambda: torch, _replacements("functions", "torch.")),
    shared_patch("pending draws", "torch.Tensor", lambda: torch.Tensor, _replacements("methods", "Tensor.")),
)
