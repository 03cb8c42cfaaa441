"""Devices of fake tensors: normalisation, the default device, output rules.

A fake tensor reports a real device although its data lives nowhere. The
rules that choose the device of an operator's outputs follow the torchdistx
design note: an explicit ``device`` argument wins; otherwise the tensors'
common device (a 0-dim CPU tensor yields to the others, as in eager
PyTorch); otherwise CPU.
"""

from __future__ import annotations

import torch

CPU = torch.device("cpu")
META = torch.device("meta")

# Operators that legitimately take tensors on different devices (a copy
# between devices, CPU index tensors into a CUDA tensor).  Their outputs live
# on the device of their first tensor argument.
_MIXED_DEVICE_OK = frozenset(
    {
        "copy_",
        "_to_copy",
        "_copy_from",
        "_copy_from_and_resize",
        "copy",
        "index",
        "index_put_",
        "index_put",
        "_index_put_impl_",
        "set_",
        "lift_fresh",
        "lift_fresh_copy",
    }
)


_KINDS: dict = {}


def kind_of(device: torch.device) -> str:
    """``device.type``, remembered per device: the property builds its string
    anew on every call (about 1.6 us, several times per recorded op).

    Example::

        >>> kind_of(torch.device("cuda", 1))
        'cuda'
    """
    kind = _KINDS.get(device)
    if kind is None:
        kind = _KINDS[device] = device.type
    return kind


def normalize(device) -> torch.device:
    """Return ``device`` as a ``torch.device`` with an index where real tensors have
    one, and none where they have none (``cpu:0`` tensors report ``cpu``).

    Example::

        >>> normalize("cuda"), normalize("cpu:0")
        (device(type='cuda', index=0), device(type='cpu'))
    """
    if type(device) is not torch.device:
        device = torch.device(device)
    kind = kind_of(device)
    if kind in ("cpu", "meta"):
        return device if device.index is None else torch.device(kind)
    if device.index is None:
        index = 0
        if kind == "cuda" and torch.cuda.is_available():
            index = torch.cuda.current_device()
        device = torch.device(kind, index)
    return device


from torch._C import _get_function_stack_at as _stack_at  # noqa: E402
from torch._C import _len_torch_function_stack as _stack_len  # noqa: E402
from torch.utils._device import DeviceContext as _DeviceContext  # noqa: E402


def default_device() -> torch.device:
    """The device factories use when none is given: ``torch.device(...)`` contexts
    and ``torch.set_default_device`` included, without touching any backend."""
    n = _stack_len()
    while n:
        n -= 1
        mode = _stack_at(n)
        if type(mode) is _DeviceContext:
            return mode.device
    ctx = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    if ctx is not None:
        return ctx.device
    return CPU


def exists(device: torch.device) -> bool:
    """Whether real tensors can be allocated on ``device`` in this process."""
    kind = device.type
    if kind in ("cpu", "meta"):
        return True
    module = getattr(torch, kind, None)
    is_available = getattr(module, "is_available", None)
    if is_available is None or not is_available():
        return False
    if device.index is not None and hasattr(module, "device_count"):
        return device.index < module.device_count()
    return True


def backend_device(device: torch.device) -> torch.device:
    """The device the C++ side of a fake sits on.

    A fake reports its device from Python.  Where this build has the
    backend, the C++ side agrees; where it does not (``cuda`` on a CPU-only
    build), it sits on CPU: autograd builds its graph from the C++ device and
    would abort the process on a backend without a device guard, as
    PyTorch's own FakeTensorMode does.
    """
    backend = _backend.get(device)
    if backend is None:
        backend = _backend[device] = device if kind_of(device) in ("cpu", "meta") or exists(device) else CPU
        if backend != device:
            BACKENDLESS.add(device)
    return backend


_backend: dict = {}
# The devices fakes were made for whose backend this build lacks: while there
# are none (the usual case), no call needs its CPU devices read as another.
BACKENDLESS: set = set()


def common_device(op_name: str, devices: list[tuple[torch.device, bool]]) -> torch.device | None:
    """The device of an operator's outputs given its tensor arguments.

    ``devices`` holds ``(device, is_cpu_scalar)`` for each tensor argument in
    order.  Returns None when there are no tensors.
    """
    if not devices:
        return None
    first = devices[0][0]
    chosen = None
    for device, is_cpu_scalar in devices:
        if is_cpu_scalar:
            continue
        if chosen is None:
            chosen = device
        elif device != chosen:
            if op_name in _MIXED_DEVICE_OK:
                return first
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at "
                f"least two devices, {chosen} and {device}! (in {op_name} on fake tensors)"
            )
    return chosen if chosen is not None else first
