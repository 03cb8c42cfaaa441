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
interrupted, at any line) no helper writes into the buffer: one still to
start finds nothing left and ends without touching it; and an interrupt
never leaves the call waiting for a piece no one reads.
"""

from __future__ import annotations

import itertools
import threading

import torch

# A piece: whole pages (a multiple of every element size), big enough that
# taking it costs nothing next to reading it, small enough that a tensor of
# a few MB is shared between threads.
PIECE_BYTES = 1 << 20


def in_pieces(read, position: int, buffer: memoryview) -> None:
    """``read(position, buffer)`` of a large buffer, in pieces read by this thread
    and up to ``torch.get_num_threads() - 1`` others; an error of a piece (the
    caller's own first) is raised once no piece is being read.

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
    team = _Team(read, position, buffer)
    # Every line from the first helper's start on is inside the try: an
    # interrupt anywhere (a Ctrl-C between two lines, a helper that cannot be
    # started) closes the team before it goes on.
    try:
        for _ in range(helpers):
            try:
                threading.Thread(target=team.help, name="deferinit-pread", daemon=True).start()
            except RuntimeError:  # "can't start new thread": read with those there are
                break
        team.work()
        interrupt = team.close()
    except BaseException:
        team.close()
        raise
    if interrupt is not None or team.error is not None:
        raise interrupt or team.error


class _Team:
    """The pieces of one buffer, taken one at a time by the caller (:meth:`work`)
    and helpers (:meth:`help`).  The caller takes no lock and counts nothing:
    an interrupt at any of its lines (a Ctrl-C) can neither leave a lock held
    nor a piece counted that no one reads, which :meth:`close` would wait for
    forever.  A helper counts itself busy *before* it looks whether the team
    is open, and the caller closes it before it looks whether any helper is
    busy: a helper either is waited for or finds the team closed."""

    def __init__(self, read, position: int, buffer: memoryview):
        self.read, self.position, self.buffer = read, position, buffer
        self.taken = itertools.count()  # next() is atomic: the pieces need no lock
        self.lock = threading.Lock()  # helpers' counts
        self.drained = threading.Event()  # set when no helper is busy
        self.open = True
        self.busy = 0  # helpers between taking a piece and handing it back
        self.error = None  # the first error of a helper's piece

    def _next(self):
        """The offset of the next piece, or None (none left, closed, or a helper failed)."""
        if not self.open or self.error is not None:
            return None
        at = next(self.taken) * PIECE_BYTES
        return at if at < len(self.buffer) else None

    def work(self) -> None:
        """The caller's part: pieces until none is left; its own errors raised at once."""
        while (at := self._next()) is not None:
            self.read(self.position + at, self.buffer[at : at + PIECE_BYTES])

    def help(self) -> None:
        while True:
            with self.lock:
                self.busy += 1
            at = self._next()
            error = None
            if at is not None:
                try:
                    self.read(self.position + at, self.buffer[at : at + PIECE_BYTES])
                except BaseException as e:  # handed to the caller, raised there
                    error = e
            with self.lock:
                self.error = self.error or error
                self.busy -= 1
                if not self.busy:
                    self.drained.set()
            if at is None:
                return

    def close(self):
        """No piece is taken from now on; returns once no helper reads one, even
        through interrupts (the first one is returned, to be raised then)."""
        interrupt = None
        while True:
            try:
                self.open = False
                while self.busy:
                    self.drained.clear()
                    if self.busy:  # a helper sets it after the clear once it is done
                        self.drained.wait(0.1)
                return interrupt
            except BaseException as e:
                interrupt = interrupt or e
