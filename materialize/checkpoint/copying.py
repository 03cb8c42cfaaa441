"""Copying a strided piece of a checkpoint file into a real tensor.

A file holds a tensor's elements at byte ``base + index * itemsize``; the
piece to copy is ``offset + sum(i_k * strides[k])`` for every index ``i`` of
``sizes`` (the whole tensor, a shard, a column block...), and the
destination is any real tensor of shape ``sizes``.  The index space is cut
into *runs*, stretches contiguous in the file and in the destination, and
each run is read with ``pread`` straight into the destination's memory (a
large run in pieces, by several threads: :mod:`.parallel`) when its dtype is
the file's and it lives on the CPU: no intermediate copy, and the file's
pages stay in the page cache, not in this process (bools are then stored as
0 or 1, as ``copy_`` stores them).
Otherwise (another dtype, another device) rows of at most
:data:`CHUNK_BYTES` are read into a buffer and copied with ``copy_``, which
casts as ``load_state_dict`` does.
"""

from __future__ import annotations

import math

import numpy
import torch

from deferinit.fake.extent import extent

# Bytes read into one intermediate buffer when the destination cannot take
# the file's bytes as they are (another dtype or device).
CHUNK_BYTES = 64 << 20
# Runs shorter than this, many of them, are read as one span instead.
_SHORT_RUN_BYTES = 256
_MANY_RUNS = 1 << 16


def runs(sizes, src_strides, dst_strides):
    """``(src offsets, dst offsets, run length)``: the starts of the stretches of
    ``run length`` elements contiguous in both layouts (offsets as int64 tensors).

    Example::

        >>> src, dst, n = runs((4, 6), (10, 1), (6, 1))   # columns 0-5 of a [4, 10] tensor
        >>> src.tolist(), dst.tolist(), n
        ([0, 10, 20, 30], [0, 6, 12, 18], 6)
    """
    dims = [(n, s, d) for n, s, d in zip(sizes, src_strides, dst_strides) if n != 1]
    run = 1
    while dims and dims[-1][1] == run and dims[-1][2] == run:
        run *= dims.pop()[0]
    src = torch.zeros(1, dtype=torch.int64)
    dst = torch.zeros(1, dtype=torch.int64)
    for n, s, d in dims:
        index = torch.arange(n, dtype=torch.int64)
        src = (src[:, None] + index * s).reshape(-1)
        dst = (dst[:, None] + index * d).reshape(-1)
    return src, dst, run


def writable_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t``'s storage (a CPU tensor), writable."""
    with torch.no_grad():
        raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return memoryview(raw.numpy())


def copy_strided(read, base: int, dtype: torch.dtype, offset: int, sizes, strides, dst: torch.Tensor, via=None) -> int:
    """Copy the file's elements ``offset + i . strides`` (``i`` over ``sizes``) into
    ``dst``; ``read(position, buffer)`` fills ``buffer`` with the file's bytes at
    ``position``.  ``via``: a dtype to cast to before ``dst``'s (two casts, as a
    load followed by a copy would make).  Returns the bytes read."""
    sizes = tuple(sizes)
    if math.prod(sizes) == 0:
        return 0
    size = dtype.itemsize
    if dst.device.type == "cpu" and dst.dtype == dtype and via is None and not dst.is_conj() and not dst.is_neg():
        src_off, dst_off, run = runs(sizes, strides, dst.stride())
        if len(src_off) > _MANY_RUNS and run * size < _SHORT_RUN_BYTES:
            return _copy_span(read, base, dtype, offset, sizes, strides, dst, via)
        memory = writable_bytes(dst)
        start = dst.storage_offset()
        n = run * size
        for s, d in zip(src_off.tolist(), dst_off.tolist()):
            at = (start + d) * size
            read(base + (offset + s) * size, memory[at : at + n])
            if dtype == torch.bool:
                # copy_ stores a bool as 0 or 1, whatever byte the file holds.
                raw = numpy.frombuffer(memory[at : at + n], dtype=numpy.uint8)
                numpy.minimum(raw, 1, out=raw)
        torch._C._increment_version((dst,))
        return len(src_off) * n
    if not sizes:
        buffer = torch.empty((), dtype=dtype)
        done = copy_strided(read, base, dtype, offset, (), (), buffer)
        dst.copy_(buffer if via is None else buffer.to(via))
        return done
    # Through a buffer, a block of rows at a time.
    row = math.prod(sizes[1:]) * size
    step = max(1, CHUNK_BYTES // max(row, 1))
    done = 0
    for i in range(0, sizes[0], step):
        k = min(step, sizes[0] - i)
        buffer = torch.empty((k, *sizes[1:]), dtype=dtype)
        done += copy_strided(read, base, dtype, offset + i * strides[0], buffer.shape, strides, buffer)
        dst.narrow(0, i, k).copy_(buffer if via is None else buffer.to(via))
    return done


def _copy_span(read, base, dtype, offset, sizes, strides, dst, via) -> int:
    """Many tiny runs (a thin column block): read the span they lie in at once."""
    span = torch.empty(extent(sizes, strides), dtype=dtype)
    done = copy_strided(read, base, dtype, offset, span.shape, (1,), span)
    piece = span.as_strided(sizes, strides, 0)
    dst.copy_(piece if via is None else piece.to(via))
    return done
