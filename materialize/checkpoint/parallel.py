"""Reading one large stretch of a file with several threads at once.

Most of the time of a ``pread`` into a tensor just allocated goes to the
kernel faulting in and zeroing its fresh pages, not to copying from the page
cache; ``copy_`` (what ``load_state_dict`` does) spreads that over torch's
intra-op threads, and so do these reads: a buffer of at least two
:data:`PIECE_BYTES` is cut into pieces that the calling thread and up to
``torch.get_num_threads() - 1`` helper threads take one at a time, each read
by its own ``pread``, which releases the GIL.  Taking pieces as they go,
rather than a share each, matters on a busy machine: a helper that is not
scheduled takes nothing, the caller reads on, and the call waits at most for
the pieces helpers are reading.  Once the call returns (or raises, or is
interrupted) no helper writes into the buffer: one still to start finds
nothing left and ends without touching it.
"""

from __future__ import annotations

import threading

import torch

# A piece: whole pages (a multiple of every element size), big enough that
# taking it costs nothing next to reading it, small enough that a tensor of
# a few MB is shared between threads.
PIECE_BYTES = 1 << 20


def in_pieces(read, position: int, buffer: memoryview) -> None:
    """``read(position, buffer)`` of a large buffer, in pieces read by this thread
    and up to ``torch.get_num_threads() - 1`` others; the first error a piece
    meets is raised once no piece is being read.

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
    helpers = min(torch.get_num_threads(), n // PIECE_BYTES) - 1
    if helpers < 1:
        read(position, buffer)
        return
    pieces = iter(range(0, n, PIECE_BYTES))
    idle = threading.Condition()
    state = {"open": True, "busy": 0, "error": None}

    def work():
        while True:
            with idle:
                at = next(pieces, None) if state["open"] and state["error"] is None else None
                if at is None:
                    return
                state["busy"] += 1
            error = None
            try:
                read(position + at, buffer[at : at + PIECE_BYTES])
            except BaseException as e:  # handed to the caller, raised there
                error = e
            with idle:
                state["busy"] -= 1
                state["error"] = state["error"] or error
                idle.notify_all()

    for _ in range(helpers):
        threading.Thread(target=work, name="deferinit-pread", daemon=True).start()
    interrupt = None
    try:
        work()
    finally:
        with idle:  # no piece taken from now on; wait for those being read, even through an interrupt
            state["open"] = False
            while state["busy"]:
                try:
                    idle.wait()
                except BaseException as e:
                    interrupt = interrupt or e
    if interrupt is not None or state["error"] is not None:
        raise interrupt or state["error"]
