"""cuDNN answers fake CUDA tensors as a CPU build does, where no CUDA device exists.

A CUDA build of torch ships cuDNN, so ``torch.backends.cudnn.is_acceptable``
accepts any tensor that reports ``cuda``, GPU or not: on a machine without
one, code that asks it about fake CUDA tensors goes on to cuDNN's own paths
(``nn.LSTM``'s ``flatten_parameters`` reads every weight's ``data_ptr()``
and calls ``_cudnn_rnn_flatten_weight``), which a CPU build never reaches
(there ``is_acceptable`` says no).  No protocol reaches that question (it
reads a process flag in C++, not a tensor), so while fake modes that make
fake CUDA tensors are entered in a process that has no CUDA device, cuDNN is
reported disabled through its own switch (``torch.backends.cudnn.flags``'
flag); the first holder turns it off, the last one puts back what it was.
Nothing can run cuDNN in such a process, so no computation changes; only a
thread reading ``torch.backends.cudnn.enabled`` meanwhile sees ``False``.
"""

from __future__ import annotations

import threading

import torch

from .locking import locked

_lock = threading.Lock()
_holders: set = set()
_saved: bool | None = None  # what the switch said before the first holder


def _applies() -> bool:
    return bool(torch.backends.cudnn.is_available()) and not torch.cuda.is_available()


class cudnn_as_on_cpu_builds:
    """Report cuDNN disabled while the block runs, if ``fake_cuda`` and this CUDA
    build has no device (nothing changes otherwise).  Held as ``holder`` (a
    :class:`~deferinit.fake.guard.Entry`, whose caller releases it with
    :func:`release` if the block's exit is interrupted); a class, not a
    generator (see :mod:`deferinit.fake.guard`).

    Example::

        >>> with cudnn_as_on_cpu_builds(True):
        ...     enabled = torch.backends.cudnn.enabled
        >>> enabled == (torch.backends.cudnn.enabled and not _applies())
        True
    """

    __slots__ = ("fake_cuda", "holder")

    def __init__(self, fake_cuda: bool, holder=None):
        self.fake_cuda = fake_cuda
        self.holder = object() if holder is None else holder

    def __enter__(self) -> None:
        if self.fake_cuda and _applies():
            locked(_lock, _change, _holders.add, self.holder)

    def __exit__(self, *exc) -> None:
        release(self.holder)


def release(holder) -> None:
    """Stop holding as ``holder`` (idempotent: nothing if it does not hold)."""
    if holder in _holders:
        locked(_lock, _change, _holders.discard, holder)


def _change(change, holder) -> None:
    # Settled whatever line an interrupt arrives at: see deferinit.fake.guard.
    try: change(holder); _settle()  # noqa: E701,E702
    finally:
        try: _settle()  # noqa: E701
        finally: _settle()  # noqa: E701


def _settle() -> None:
    global _saved
    if _holders and _saved is None:
        _saved = torch._C._get_cudnn_enabled()
        torch._C._set_cudnn_enabled(False)
    elif not _holders and _saved is not None:
        torch._C._set_cudnn_enabled(_saved)
        _saved = None
