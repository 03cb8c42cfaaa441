"""Below autograd for a block: grad mode off, inference mode as asked, put back at whatever line an interrupt arrives.

torch's inference-mode guard is a C++ object (``torch._C._InferenceMode``)
that saves grad mode, inference mode and the thread's dispatch keys when
made and puts all of them back when freed.  Held by a ``torch.inference_mode``
object whose ``__exit__`` an interrupt skipped, it was freed whenever the
collector got to it: later, out of order with the guards made after it, it
put back keys and modes that were no longer the ones to put back (it
excluded the Python dispatch keys for good).  Here the guard is held on a
per-thread stack that every :class:`~deferinit.fake.guard.Entry` notes and
cuts back, last made first freed: an interrupted call frees its guards, in
order, before anything else of the thread is put back.
"""

from __future__ import annotations

import threading

import torch

from .guard import register

_local = threading.local()


def _guards() -> list:
    stack = getattr(_local, "guards", None)
    if stack is None:
        stack = _local.guards = []
    return stack


def _free_down_to(depth: int) -> None:
    """Free this thread's guards above ``depth``, the last made first (each puts
    back what it saved; idempotent)."""
    stack = _guards()
    while len(stack) > depth:
        stack.pop()  # the only reference: the C++ destructor runs here


register(lambda: len(_guards()), _free_down_to)


class below_autograd:
    """``inference_mode()`` for the block if ``inference``; otherwise ``no_grad()``,
    leaving an ambient inference mode for the block (tensors recorded as
    normal ones stay normal when made inside one).  A class, not a
    ``contextlib`` generator, with an idempotent exit run twice over (see
    :mod:`deferinit.fake.guard`).

    Example::

        >>> with torch.inference_mode(), below_autograd(False):
        ...     torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        (False, False)
        >>> torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        (False, True)
    """

    __slots__ = ("inference", "grad", "depth")

    def __init__(self, inference: bool) -> None:
        self.inference = inference
        self.grad = self.depth = None

    def __enter__(self) -> None:
        self.grad, self.depth = torch.is_grad_enabled(), len(_guards())
        if self.inference or torch.is_inference_mode_enabled():
            # No guard where none is needed: outside inference mode no_grad is all.
            _guards().append(torch._C._InferenceMode(self.inference))
        torch._C._set_grad_enabled(False)

    def __exit__(self, *exc) -> None:
        try: self._exit()  # noqa: E701 - one line each: see deferinit.fake.guard
        finally: self._exit()  # noqa: E701

    def _exit(self) -> None:
        if self.depth is None:
            return
        _free_down_to(self.depth)  # the guard puts back grad mode as at its making
        if torch.is_grad_enabled() != self.grad:
            torch._C._set_grad_enabled(self.grad)
