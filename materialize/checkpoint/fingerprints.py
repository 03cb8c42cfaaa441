"""What a checkpoint tensor holds, as a short digest ranks can compare.

``distribute_tensor`` and ``parallelize_module`` (default
``src_data_rank=0``) give every rank rank 0's piece of each tensor.  A
deferred tensor is not sent: the ranks compare the recipes of their own
copies (:mod:`deferinit.collectives`), and when a checkpoint load is part
of the recipe, what is compared is this digest of the loaded values,
whatever the file is called on each rank: the tensor's dtype and shape and
its elements, all of them for a tensor of at most :data:`FULL_BYTES`, else
:data:`SAMPLES` elements spread evenly over it (the first and the last
included), read like any part of the tensor (a few small ``pread``\\ s).
Two checkpoints that differ only between the sampled elements are not told
apart; load after sharding, or pass ``src_data_rank=None``, to keep each
rank's own file's piece instead.

Example::

    >>> from deferinit.materialize.checkpoint.entries import MemorySource
    >>> a = MemorySource.entry("w", torch.ones(3))
    >>> digest(a) == digest(MemorySource.entry("w", torch.ones(3)))
    True
    >>> digest(a) == digest(MemorySource.entry("w", torch.zeros(3)))
    False
"""

from __future__ import annotations

import hashlib
import math

import torch

from deferinit.ir.boxes import unravel

SAMPLES = 64
FULL_BYTES = 1 << 16


def digest(entry) -> bytes:
    """A digest of the values of checkpoint tensor ``entry`` (see the module's doc)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((str(entry.dtype), tuple(entry.shape))).encode())
    numel = math.prod(entry.shape)
    with torch.no_grad():
        if numel * entry.dtype.itemsize <= FULL_BYTES:
            values = torch.empty(entry.shape, dtype=entry.dtype)
            entry.read_parts(values)
        else:
            values = torch.empty(SAMPLES, dtype=entry.dtype)
            for k in range(SAMPLES):
                index = unravel(k * (numel - 1) // (SAMPLES - 1), entry.shape)
                offset = sum(i * s for i, s in zip(index, entry.strides))
                entry.read(values[k], offset, (), ())
        h.update(values.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()
