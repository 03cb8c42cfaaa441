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

import contextlib
import threading

import torch

_lock = threading.Lock()
_holders = 0
_saved: bool | None = None


def _applies() -> bool:
    return bool(torch.backends.cudnn.is_available()) and not torch.cuda.is_available()


@contextlib.contextmanager
def cudnn_as_on_cpu_builds(fake_cuda: bool):
    """Report cuDNN disabled while the block runs, if ``fake_cuda`` and this CUDA
    build has no device (nothing changes otherwise).

    Example::

        >>> with cudnn_as_on_cpu_builds(True):
        ...     enabled = torch.backends.cudnn.enabled
        >>> enabled == (torch.backends.cudnn.enabled and not _applies())
        True
    """
    if not fake_cuda or not _applies():
        yield
        return
    global _holders, _saved
    held = False
    try:
        with _lock:
            if _holders == 0:
                _saved = torch._C._get_cudnn_enabled()
                torch._C._set_cudnn_enabled(False)
            _holders += 1
            held = True
        yield
    finally:
        if held:
            with _lock:
                _holders -= 1
                if _holders == 0:
                    torch._C._set_cudnn_enabled(_saved)
                    _saved = None
