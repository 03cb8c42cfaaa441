"""How the interpreter runs what dead-work elimination marked, and checkpoint loads.

:mod:`deferinit.liveness` decides, for each planned node, whether it runs
as recorded or otherwise: its outputs only *allocated* (their contents are
all overwritten later), a random draw replayed only for the *generator*
(into scratch memory), a ``copy_`` that reads a checkpoint *directly* into
its destination.  Load nodes (recorded by :func:`deferinit.materialize.load_checkpoint`)
read their checkpoint's bytes into the tensor, or only the parts that are
read later.  This module is the part of :class:`deferinit.materialize.replay.Replay`
that carries those decisions out.
"""

from __future__ import annotations

import torch

from deferinit.liveness import ALLOC, DIRECT


def run_marked(replay, node, mode, env, real_views, wanted) -> bool:
    """Run ``node`` if its mode (or kind) asks for more than the recorded call;
    returns False when the interpreter should run it as recorded."""
    if mode == ALLOC:
        for pos, value in replay.liveness.alloc[id(node)].items():
            if pos in wanted:
                env[(node, pos)] = torch.empty_strided(
                    value.size, value.stride, dtype=value.dtype, device=replay.device_map(value.device)
                )
        return True
    if mode == DIRECT:
        load, (offset, sizes, strides), *parts = replay.liveness.direct[id(node)]
        dst = replay._resolve(node.flat[0], env, real_views)
        source = load.payload
        # The load cast the checkpoint to its tensor's dtype, the copy to the
        # destination's: the same two casts, unless one of them is none.
        middle = load.flat[0].value.dtype
        via = None if middle in (source.dtype, dst.dtype) else middle
        if not parts:
            source.read(dst, offset, sizes, strides, via=via)
            return True
        for start, box in parts[0]:
            # Only the blocks of the destination something reads later.
            at = dst.storage_offset() + sum(i * s for i, s in zip(start, dst.stride()))
            view = dst.as_strided(box, dst.stride(), at)
            source.read(view, offset + sum(i * s for i, s in zip(start, strides)), box, strides, via=via)
        return True
    if node.kind == "load":
        dst = replay._resolve(node.flat[0], env, real_views)
        parts = replay.liveness.loads.get(id(node)) if replay.liveness is not None else None
        node.payload.read_parts(dst, parts)
        return True
    return False


def scratch_for(inp, device_map) -> torch.Tensor:
    """Memory of ``inp``'s geometry for a draw whose values nothing reads: the
    kernel consumes the generator as it would on the real tensor."""
    value = inp.value
    return torch.empty_strided(value.size, value.stride, dtype=value.dtype, device=device_map(value.device))


def check_sources(replay) -> None:
    """Before anything runs: every checkpoint the plan reads is still there, as
    recorded (so that a missing or changed file fails the replay at once)."""
    seen = set()
    for node in replay.order:
        load = node if node.kind == "load" else None
        if load is None and replay.mode(node) == DIRECT:
            load = replay.liveness.direct[id(node)][0]
        if load is not None and id(load.payload) not in seen:
            seen.add(id(load.payload))
            load.payload.check()
