"""``materialize_tensor`` and ``materialize_module``."""

from __future__ import annotations

import os
import sys

import torch

from deferinit.recorder import is_deferred_fake
from deferinit.replay import Replay, read_of
from deferinit.rng import generator_of, get_state, same_state, set_state
from deferinit.where import tensor_names

from .swap import dress, swap_all

# Materializations of at least this many tensors may show a progress bar.
PROGRESS_MIN_TENSORS = 16


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
    _materialize([("tensor", fake)], device=device, inference=inference, progress=False, complete=False)
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
    ``progress=True`` (or ``DEFERINIT_PROGRESS=1``) shows a tqdm bar on a
    terminal.  After a complete materialization the default generator is
    left where eager construction would have left it, provided nothing drew
    from it since ``deferred_init``.

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
        complete = check_fn is None and not buffers_only
        from .distributed import materialize_sharded  # DTensor/FSDP2 modules: shard by shard

        if not materialize_sharded(module, targets, device=device, inference=inference, progress=progress, complete=complete):
            _materialize(targets, device=device, inference=inference, progress=progress, complete=complete)
    return module


def _materialize(targets, *, device, inference, progress, complete) -> None:
    reads = [read_of(fake) for _, fake in targets]
    labels = [name for name, _ in targets]
    records = {id(f._record): f._record for _, f in targets}
    finish = _streams_to_finish(records.values()) if complete and device is None else []
    bar = _progress_bar(progress, len(targets))
    replay = Replay(
        reads,
        device=device,
        inference=inference,
        labels=labels,
        progress=bar.update_to if bar is not None else None,
        extra=finish,
    )
    try:
        reals = replay.run()
    finally:
        if bar is not None:
            bar.close()

    storages = [fake._storage for _, fake in targets]
    pairs = [(fake, dress(fake, real, inference)) for (_, fake), real in zip(targets, reals)]
    swap_all(pairs)

    remember_real_storages(reads, storages, reals)
    if device is None:
        _hand_over_generators(replay, records.values())


def remember_real_storages(reads, storages, reals) -> None:
    """After a swap: each recorded storage remembers its real memory and the
    head it reflects, so that its other tensors, materialized later, share it."""
    for read, storage, real in zip(reads, storages, reals):
        if storage.real is None and read.value.same_geometry(real):
            storage.real = real.untyped_storage()
        if storage.real is not None:
            storage.real_head = read.version


def _streams_to_finish(records) -> list:
    """The last draw of each of the records' streams whose final state is unknown,
    when the generator is still where deferral left it (so it can be advanced)."""
    nodes = []
    for record in records:
        for key, stream in record.streams.items():
            end = _end_of(stream)
            if not stream.nodes or end in stream.known:
                continue
            exit_state = record.exit.get(key)
            gen = generator_of(key) if exit_state is not None else None
            if gen is None or not same_state(get_state(gen), exit_state):
                continue
            nodes.append(stream.nodes[end - 1])
    return nodes


def _end_of(stream) -> int:
    """The position whose state eager construction left the generator in (the
    end of the stream, or an earlier one put back after the last draw)."""
    end = len(stream.nodes)
    while end in stream.same:
        end = stream.same[end]
    return end


def _hand_over_generators(replay: Replay, records) -> None:
    """Leave each generator where eager construction would have, if nothing drew
    from it since deferral and the replay now knows that state."""
    for record in records:
        for key, stream in record.streams.items():
            post = stream.known.get(_end_of(stream))
            exit_state = record.exit.get(key)
            if post is None or exit_state is None:
                continue
            gen = generator_of(key)
            if gen is not None and same_state(get_state(gen), exit_state):
                set_state(gen, post)


class _Bar:
    def __init__(self, total_tensors):
        from tqdm import tqdm

        self._bar = tqdm(total=None, desc=f"materializing {total_tensors} tensors", unit="op", leave=False)

    def update_to(self, done, total):
        if self._bar.total != total:
            self._bar.total = total
        self._bar.n = done
        if done == total or done % 64 == 0:
            self._bar.refresh()

    def close(self):
        self._bar.close()


def _progress_bar(progress, n_tensors):
    if progress is None:
        progress = os.environ.get("DEFERINIT_PROGRESS", "") not in ("", "0")
    if not progress or n_tensors < PROGRESS_MIN_TENSORS or not sys.stderr.isatty():
        return None
    try:
        return _Bar(n_tensors)
    except ImportError:
        return None
