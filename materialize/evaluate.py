"""Values needed while recording: ``.item()``, ``bool()``, ``.tolist()`` on a deferred fake.

Constructors sometimes read numbers from tensors they just made (timm:
``[x.item() for x in torch.linspace(0, rate, depth)]``).  Such a value is
computed for real, by replaying its closure on its own device, exactly as
materialization would (a random value is the number eager init would have
seen).  The user's generators are left untouched, and nothing is kept: the
tensor stays deferred.
"""

from __future__ import annotations

import os

from deferinit.errors import DataDependentError
from deferinit.exclusive import exclusive
from deferinit.where import constructing, recording
from deferinit.fake.device import exists
from deferinit.fake.locking import locked
from deferinit.fake.tensor import describe

from deferinit.ir.plan import DeviceMap
from deferinit.random.streams import replay_streams, state_before, walk_back

from .replay import Replay, read_of

# Largest closure (bytes of the tensors read) computed while recording.
LIMIT_BYTES = int(os.environ.get("DEFERINIT_EVAL_LIMIT_BYTES", str(1 << 30)))


def evaluate(fakes, operation: str):
    """Real tensors with the current values of deferred ``fakes``.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 2, 3)
        >>> (w,) = evaluate([m.weight], "item()")
        >>> w.shape, is_deferred(m.weight)
        (torch.Size([3, 2]), True)
    """
    # The graph it reads may be a finished record another thread materializes.
    return locked(exclusive(), _evaluate, fakes, operation)


def _evaluate(fakes, operation: str):
    for fake in fakes:
        if not exists(fake.device):
            raise DataDependentError(
                f"{operation} on a deferred tensor {describe(fake)} needs its value "
                f"{recording()}, and {fake.device} does not "
                "exist in this process, so the value eager init would see cannot be computed. "
                "Record on a device that exists here (e.g. device='cpu') and move the module "
                "later, or avoid reading tensor values in the constructor."
            )
    replay = Replay([read_of(f) for f in fakes], labels=[f"{operation} operand" for _ in fakes])
    size = _closure_bytes(replay)
    if size > LIMIT_BYTES:
        raise DataDependentError(
            f"{operation} on a deferred tensor {describe(fakes[0])} needs its value "
            f"{recording()}; computing it would allocate about "
            f"{size / 2**20:.0f} MiB (limit DEFERINIT_EVAL_LIMIT_BYTES={LIMIT_BYTES}). Raise the "
            "limit, or avoid reading tensor values in the constructor."
        )
    return replay.run()


def _closure_bytes(replay: Replay) -> int:
    seen = set()
    total = 0
    for node in replay.plan.order:
        for x in node.flat:
            value = getattr(x, "value", None)
            if value is not None and id(value) not in seen:
                seen.add(id(value))
                n = 1
                for d in value.size:
                    n *= d
                total += n * value.dtype.itemsize
    return total


def generator_state(stream, k: int):
    """The exact state of ``stream``'s generator right before its draw ``k`` (see
    :func:`deferinit.random.streams.state_before`), while recording: the draws since the
    nearest known state are jumped over on CPU, replayed into scratch memory
    otherwise (on private generators: nothing anyone can see changes), and
    the state reached is remembered by the record.

    Example::

        >>> def build():
        ...     torch.rand(3)
        ...     return torch.get_rng_state()   # calls generator_state
        >>> _ = torch.manual_seed(0); state = deferred_init(build)
        >>> _ = torch.manual_seed(0); _ = torch.rand(3); torch.equal(state, torch.get_rng_state())
        True
    """
    state = state_before(stream, k)
    if state is None:
        # The stream may continue a finished record's, whose states replays cache.
        state = locked(exclusive(), _replayed, stream, k)
    if state is None:
        raise DataDependentError(
            f"the state of the {stream.device} generator is needed while recording "
            f"(constructing {constructing()}), and it cannot be read in this process. "
            "Record on a device that exists here, or avoid reading generator states in the constructor."
        )
    return state


def _replayed(stream, k):
    rs = replay_streams([stream], DeviceMap())[id(stream)]
    draws: list = []
    walk_back(rs, k, draws)
    if draws:
        Replay([], extra=draws, labels=["the generator state"]).run()
    return state_before(rs, k)
