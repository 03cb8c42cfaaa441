"""Per-thread state of the Fake layer.

Python factory calls parse ``device=`` before any dispatch happens, and a
CUDA device on a CPU-only build fails right there.  The function layer
therefore rewrites such devices to ``meta`` and leaves the device the caller
meant here; the dispatch layer picks it up when it sees ``device=meta``.
"""

from __future__ import annotations

import threading

import torch


class _State(threading.local):
    def __init__(self) -> None:
        # Devices the caller asked for, innermost last.
        self.intended: list[torch.device] = []


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
