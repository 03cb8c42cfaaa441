"""Reading one large stretch of a file with several threads at once.

Most of the time of a ``pread`` into a tensor just allocated goes to the
kernel faulting in and zeroing its fresh pages, not to copying from the page
cache; ``copy_`` (what ``load_state_dict`` does) spreads that over torch's
intra-op threads, and so do these reads: a buffer of at least two
:data:`PIECE_BYTES` is cut into one piece per thread (at most
``torch.get_num_threads()``), each read by its own ``pread``, which releases
the GIL.  The calling thread reads the first piece and waits for the others
however it leaves (an error, an interrupt): no thread writes into a buffer
after the call returns, and none is left behind.
"""

from __future__ import annotations

import threading

import torch

# The least a thread is given: below this, starting a thread costs more than it saves.
PIECE_BYTES = 2 << 20


def in_pieces(read, position: int, buffer: memoryview) -> None:
    """``read(position, buffer)`` of a large buffer, by up to ``torch.get_num_threads()``
    threads each reading a piece (whole 4 KiB pages, but the last); the first
    error a piece meets is raised once every piece is done.

    Example::

        >>> import os, tempfile
        >>> data = bytes(range(256)) * (1 << 15)              # 8 MiB
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.write(data)
        ...     out = bytearray(len(data))
        ...     in_pieces(lambda at, b: os.preadv(f.fileno(), [b], at), 0, memoryview(out))
        >>> out == data
        True
    """
    n = len(buffer)
    count = min(torch.get_num_threads(), n // PIECE_BYTES)
    if count < 2:
        read(position, buffer)
        return
    step = -(-n // count) + 4095 & ~4095  # whole pages: a multiple of every element size
    pieces = [(position + at, buffer[at : at + step]) for at in range(0, n, step)]
    failed: list = [None] * len(pieces)

    def work(i: int) -> None:
        try:
            read(*pieces[i])
        except BaseException as e:  # handed to the caller, raised there
            failed[i] = e

    threads = []
    try:
        for i in range(1, len(pieces)):
            t = threading.Thread(target=work, args=(i,), name="deferinit-pread", daemon=True)
            t.start()
            threads.append(t)
        read(*pieces[0])
    finally:
        _join(threads)
    for e in failed:
        if e is not None:
            raise e


def _join(threads) -> None:
    """Wait for every thread, even through an interrupt (raised once they are done)."""
    interrupt = None
    for t in threads:
        while True:
            try:
                t.join()
                break
            except BaseException as e:  # a KeyboardInterrupt in the wait: the thread still writes
                interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt
