"""Real random draws after a deferral whose own draws on that generator are still pending.

Recording draws nothing, so after ``deferred()`` each default generator is
where it was before the block; materialization replays the recorded draws
from the states eager construction drew them from and then moves the
generator to where eager construction left it.  A real draw in between
(``get_peft_model`` on a deferred base, a new ``nn.Linear`` head,
``torch.randn`` for an input) starts from the state *before* the model's
draws, where eagerly it came after them: its values, and every later draw,
differ from eager, and materialization can no longer leave the generator
where eager construction did.  Equal values would need the model's random
numbers generated at that moment (minutes for a large model), so instead
this is said when it happens: a :class:`~deferinit.errors.PendingDrawsWarning`
naming the op, the modules being built and the deferral, once per deferral.

While a closed record with draws on a default generator is alive (and only
then), PyTorch's Python entry points of random ops (the ``torch`` functions
and ``Tensor`` methods of every ATen op with a ``generator`` argument) are
diverted to a check; a draw is *pending* while that generator still holds
the state recording left it in and no seed was set through torch's API
since (a seed, a materialization's hand-over or an earlier real draw means
it is not).  Random kernels that C++
calls internally (``F.dropout``) are not seen.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref

import torch

from fake.compiling import not_inlined
from fake.patch import SharedPatch
from fake.state import in_fake_mode
from fake.tensor import FakeTensor

from .errors import PendingDrawsWarning
from .record import CHAINS, current_record
from .rng import default_generator, fingerprint, get_state
from .where import constructing

_lock = threading.Lock()
# Watched record -> the seeding epoch when it closed (deferinit.record.CHAINS).
_watched: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_warned: "weakref.WeakSet" = weakref.WeakSet()


def watch(record) -> None:
    """Check real draws against ``record`` (closed) for as long as it lives, if it drew
    from a default generator.

    Example::

        >>> from deferinit import deferred
        >>> with deferred() as record:
        ...     m = torch.nn.Linear(2, 2)
        >>> record in _watched       # deferred() watched it when it closed
        True
    """
    if not any(type(k) is torch.device and s.nodes and k in record.exit for k, s in record.streams.items()):
        return
    with _lock:
        if record in _watched:
            return
        _watched[record] = _epoch()
    for patch in PATCHES:
        patch.acquire()
    weakref.finalize(record, _release)


def _release() -> None:
    for patch in reversed(PATCHES):
        patch.release()


def _epoch():
    # Bumped by every torch.manual_seed & co. while such a record lives
    # (deferinit.seeding keeps them diverted for it).
    return getattr(CHAINS, "_epoch", None)


def _pending(device: torch.device):
    """A watched record whose draws on ``device``'s default generator are pending, or None."""
    with _lock:
        records = list(_watched.items())
    now = None
    epoch = _epoch()
    for record, at in records:
        stream = record.streams.get(device)
        state = record.exit.get(device)
        if stream is None or not stream.nodes or state is None or record in _warned or at != epoch:
            continue
        if now is None:
            gen = default_generator(device)
            if gen is None:
                return None
            now = fingerprint(get_state(gen))
        if now == fingerprint(state):
            return record
    return None


def _device_of(args, kwargs) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.get_default_device()


def _pending_draw(args, kwargs):
    """``(record, device)`` when this call draws from a default generator whose
    deferred draws are pending, else None."""
    if any(isinstance(a, FakeTensor) for a in (*args, *kwargs.values())):
        return None
    device = _device_of(args, kwargs)
    if device.type != "cpu" and default_generator(device) is None:
        return None  # a device this process does not have: eager raises next
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    generator = kwargs.get("generator")
    if generator is not None and generator is not default_generator(device):
        return None
    record = _pending(device)
    return None if record is None else (record, device)


def _check(args, kwargs):
    """``(record, device)`` for a real draw while that record's draws are pending."""
    if current_record() is not None or in_fake_mode():
        return None  # recorded, or fakes: nothing is drawn for real here
    try:
        return _pending_draw(args, kwargs)
    except Exception:  # noqa: BLE001 - arguments eager refuses: its own error comes next
        return None


def _warn(name: str, record, device) -> None:
    if record in _warned:
        return
    _warned.add(record)
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
        out = original(*args, **kwargs)
        if found is not None:  # it drew: eager's error, if any, came first
            _warn(name, *found)
        return out

    # What fake.mode's function mode calls instead (PyTorch hands Tensor
    # methods to torch-function modes by their name on torch.Tensor).
    draw.__deferinit_stands_for__ = original
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
        names = set()
        for schema in torch._C._jit_get_all_schemas():
            if schema.name.startswith("aten::") and any(a.name == "generator" for a in schema.arguments):
                names.add(schema.name[6:])
        _names["functions"] = tuple(sorted(n for n in names if callable(getattr(torch, n, None))))
        _names["methods"] = tuple(sorted(n for n in names if callable(getattr(torch.Tensor, n, None))))
    return _names["functions"], _names["methods"]


def _replacements(which: str, prefix: str):
    def make(owner) -> dict:
        names = random_ops()[0 if which == "functions" else 1]
        return {name: _checking(prefix + name, getattr(owner, name)) for name in names}

    return make


PATCHES = (
    SharedPatch(lambda: torch, _replacements("functions", "torch.")),
    SharedPatch(lambda: torch.Tensor, _replacements("methods", "Tensor.")),
)
