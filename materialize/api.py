"""``materialize_tensor`` and ``materialize_module``."""

from __future__ import annotations

import torch

from deferinit.plan import read_of
from deferinit.recorder import is_deferred_fake
from deferinit.where import tensor_names

from .generators import hand_over_generators
from .progress import start_progress
from .replay import Replay
from .sharded import materialize_sharded
from .swap import dress, remember_real_storages, swap_all


def _fake_of(t):
    """The deferred fake behind ``t`` (itself, or a DTensor's local shard), or None."""
    if is_deferred_fake(t):
        return t
    local = getattr(t, "_local_tensor", None)
    return local if is_deferred_fake(local) else None


def materialize_tensor(tensor: torch.Tensor, *, device=None, inference: bool = False) -> torch.Tensor:
    """Make a deferred tensor real, in place, and return it.

    The tensor object itself becomes real (``torch.utils.swap_tensors``):
    every reference to it (module attributes, an optimizer, a tied module)
    now sees real memory with exactly the values eager construction would
    have produced.  A real or plain fake tensor is returned as it is, and a
    second call is a no-op.  ``device=`` materializes on another device than
    the recorded one; ``inference=True`` gives inference tensors.

    Example::

        >>> m = deferred_init(torch.nn.Linear, 4, 4)
        >>> w = m.weight
        >>> materialize_tensor(w) is w, is_deferred(w)
        (True, False)
    """
    fake = _fake_of(tensor)
    if fake is None:
        return tensor
    _materialize([("tensor", fake)], device=device, inference=inference, progress=False)
    return tensor


def materialize_module(
    module: torch.nn.Module,
    buffers_only: bool = False,
    check_fn=None,
    *,
    device=None,
    inference: bool = False,
    progress: bool | None = None,
) -> torch.nn.Module:
    """Materialize every deferred parameter and buffer of ``module`` and its children.

    All tensors are computed first (one replay, intermediates freed at their
    last use) and swapped in last: if anything fails, the module is left
    exactly as it was, still deferred.  ``check_fn(submodule)`` decides
    whether a submodule's own tensors are materialized (as in torchdistx and
    FSDP); ``buffers_only`` leaves parameters deferred.  Returns ``module``;
    a second call is a no-op.

    ``device=`` maps every recorded device to this one; ``inference=True``
    replays under ``torch.inference_mode()`` and gives inference tensors;
    ``progress=True`` (or ``DEFERINIT_PROGRESS=1``) shows the tensors and
    bytes done on stderr (a tqdm bar; a terminal, Jupyter or a log) and
    leaves a one-line summary.  Once the replays know where a generator's
    stream ended (its last draw replayed), the generator is left where eager
    construction would have left it, provided nothing drew from it since
    ``deferred_init`` (with ``device=``: the target device's generator).

    Example::

        >>> _ = torch.manual_seed(0); eager = torch.nn.Transformer(d_model=64, nhead=4)
        >>> _ = torch.manual_seed(0); m = deferred_init(torch.nn.Transformer, d_model=64, nhead=4)
        >>> materialize_module(m) is m
        True
        >>> all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), m.state_dict().values()))
        True
    """
    names = tensor_names(module)
    targets = []
    seen = set()
    for _, sub in module.named_modules(remove_duplicate=False):
        if check_fn is not None and not check_fn(sub):
            continue
        tensors = list(sub._buffers.values())
        if not buffers_only:
            tensors = list(sub._parameters.values()) + tensors
        for t in tensors:
            fake = _fake_of(t)
            if fake is not None and id(fake) not in seen:
                seen.add(id(fake))
                targets.append((names.get(id(t), "?"), fake))
    if targets:
        if not materialize_sharded(module, targets, device=device, inference=inference, progress=progress):
            _materialize(targets, device=device, inference=inference, progress=progress)
    return module


def _materialize(targets, *, device, inference, progress) -> None:
    reads = [read_of(fake) for _, fake in targets]
    labels = [name for name, _ in targets]
    fakes = [fake for _, fake in targets]
    shown = start_progress(progress, fakes)
    try:
        replay = Replay(reads, device=device, inference=inference, labels=labels)
        if shown is not None:
            replay.progress = shown.replay_callback(replay, fakes)
        reals = replay.run()
        storages = [fake._storage for fake in fakes]
        pairs = [(fake, dress(fake, real, inference)) for fake, real in zip(fakes, reals)]
        swap_all(pairs)
    except BaseException:
        if shown is not None:
            shown.close(ok=False)
        raise
    if shown is not None:
        shown.close()

    remember_real_storages(reads, storages, reals)
    # The fakes swapped out die with these lists, and with them what only they
    # kept alive: draws into such tensors become temporaries of the record.
    del pairs, reals, fakes, targets
    hand_over_generators(replay.replay_streams, device)
