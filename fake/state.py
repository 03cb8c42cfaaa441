"""Per-thread state of the Fake layer.

Python factory calls parse ``device=`` before any dispatch happens, and a
CUDA device on a CPU-only build fails right there.  The function layer
therefore rewrites such devices to ``meta`` and leaves the device the caller
meant here; the dispatch layer picks it up when it sees ``device=meta``.
"""

from __future__ import annotations

import threading

import torch

from .guard import register


class _State(threading.local):
    def __init__(self) -> None:
        # Devices the caller asked for, innermost last.
        self.intended: list[torch.device] = []
        # How many fake_mode blocks are open.
        self.fake_modes = 0
        # Fake devices whose C++ side is CPU, for which explicit CPU
        # factories inside a C++ composite stand (innermost last).
        self.backend: list[torch.device] = []


_state = _State()


class intended_device:
    """Context manager: ops in this block that ask for ``meta`` meant ``device``."""

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> None:
        _state.intended.append(self.device)

    def __exit__(self, *exc) -> None:
        _state.intended.pop()


def current_intended_device() -> torch.device | None:
    """The device the innermost rewritten call meant, or None."""
    stack = _state.intended
    return stack[-1] if stack else None


class planning:
    """Context manager entered by :func:`deferinit.fake.fake_mode`: ``in_fake_mode()`` is true inside."""

    __slots__ = ()

    def __enter__(self) -> None:
        _state.fake_modes += 1

    def __exit__(self, *exc) -> None:
        _state.fake_modes -= 1


def in_fake_mode() -> bool:
    """Whether a ``fake_mode`` block is open in this thread (tensors of deferred
    models then compute as plain fakes, without recording)."""
    return _state.fake_modes > 0


class backend_stands_for:
    """Context manager: explicit CPU factories in this block mean ``device``.

    A C++ composite builds its temporaries with the options of a fake
    argument, whose C++ device is CPU where this build lacks the fake's
    backend (``deferinit.fake.device.backend_device``).
    """

    __slots__ = ("device",)

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> None:
        _state.backend.append(self.device)

    def __exit__(self, *exc) -> None:
        _state.backend.pop()


def backend_meant() -> torch.device | None:
    """The device explicit CPU factories stand for here, or None."""
    stack = _state.backend
    return stack[-1] if stack else None


def _saved():
    return len(_state.intended), _state.fake_modes, len(_state.backend)


def _restore(saved) -> None:
    intended, modes, backend = saved
    del _state.intended[intended:]
    _state.fake_modes = modes
    del _state.backend[backend:]


register(_saved, _restore)  # an interrupted call leaves these stacks as it found them
