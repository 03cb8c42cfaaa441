"""The Python-API side of fake tensors: devices in calls, before any dispatch.

``torch.ones(3, device="cuda")`` parses ``device=`` in C++ and initialises
CUDA right there, long before a dispatch mode could step in; on a CPU-only
build that is an error.  So the calls that carry a device are rewritten here:
the device becomes ``meta`` and the device meant is left in
:mod:`fake.state` for the dispatch layer.  The same applies to
``Tensor.to``, ``Tensor.cuda`` and ``Tensor.new_*`` on fakes.
"""

from __future__ import annotations

import torch

from .device import default_device, exists, normalize
from .state import intended_device

META = torch.device("meta")

# Functions whose device comes from torch.device(...) / set_default_device
# when none is given (PyTorch's own list).
from torch.utils._device import _device_constructors  # noqa: E402

CONSTRUCTORS = frozenset(_device_constructors())

# Functions that build a tensor from Python data: made on CPU (where the
# data is read), then moved.
DATA_CONSTRUCTORS = frozenset({torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor})


def needs_rewrite(device: torch.device, fake_cuda: bool = True) -> bool:
    """Whether ``device`` must not reach the argument parser."""
    if device.type in ("cpu", "meta"):
        return False
    return fake_cuda or exists(device)


def call_on_device(func, args, kwargs, device: torch.device):
    """Call ``func`` with ``device=meta`` while telling the dispatch layer it meant ``device``."""
    kwargs = dict(kwargs)
    kwargs["device"] = META
    with intended_device(device):
        return func(*args, **kwargs)


def call_with_data(func, args, kwargs, device: torch.device):
    """``torch.tensor(data, device=d)``: read the data on CPU, then move it."""
    kwargs = dict(kwargs)
    kwargs["device"] = torch.device("cpu")
    requires_grad = kwargs.pop("requires_grad", False)
    t = func(*args, **kwargs)
    t = t.to(device)
    if requires_grad:
        t.requires_grad_(True)
    return t


def parse_to(args, kwargs):
    """Split the arguments of ``Tensor.to`` into (device, dtype, other keywords)."""
    args = list(args)
    kwargs = dict(kwargs)
    device = kwargs.pop("device", None)
    dtype = kwargs.pop("dtype", None)
    if args and isinstance(args[0], torch.Tensor):
        other = args.pop(0)
        device, dtype = other.device, other.dtype
    elif args and (args[0] is None or isinstance(args[0], (str, torch.device, int))):
        # Module.to passes (device, dtype, non_blocking) positionally, device maybe None.
        device = args.pop(0)
    if args and isinstance(args[0], torch.dtype):
        dtype = args.pop(0)
    for name, value in zip(("non_blocking", "copy"), args):
        kwargs[name] = value
    if isinstance(device, int):
        device = torch.device("cuda", device)
    return (normalize(device) if device is not None else None), dtype, kwargs


def tensor_to(self: torch.Tensor, args, kwargs, fake_cuda: bool = True, *, fake: bool = False):
    """``self.to(...)`` that never lets a fake device reach the argument parser.

    For a fake (``fake=True``), C++ may hold another device than the one
    reported (see ``fake.device.backend_device``), so every move of a fake
    goes through the dispatch layer with the intended device.
    """
    device, dtype, rest = parse_to(args, kwargs)
    if device is not None and device == self.device:
        device = None
    if device is not None and device.type != "meta":
        if fake or needs_rewrite(device, fake_cuda):
            return call_on_device(torch.Tensor.to, (self,), dict(rest, dtype=dtype), device)
    return torch.Tensor.to(self, device=device, dtype=dtype, **rest)


def tensor_type_as(self: torch.Tensor, other: torch.Tensor, fake_cuda: bool = True, *, fake: bool = False):
    """``self.type_as(other)``: ``other``'s dtype and (reported) device."""
    return tensor_to(self, (other.device, other.dtype), {}, fake_cuda, fake=fake)


def tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format, fake_cuda: bool = True, *, fake: bool = False):
    target = torch.device("cuda") if device is None else torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return tensor_to(self, (), {"device": target, "non_blocking": non_blocking, "memory_format": memory_format}, fake_cuda, fake=fake)


def rewrite_call(func, args, kwargs, fake_cuda: bool):
    """Call a torch function from inside a fake mode, handling its device."""
    device = kwargs.get("device") if kwargs else None
    if device is None and func in CONSTRUCTORS:
        device = default_device()
    if device is None:
        return func(*args, **kwargs)
    device = normalize(device)
    if not needs_rewrite(device, fake_cuda):
        if kwargs.get("device") is None and func in CONSTRUCTORS:
            kwargs = dict(kwargs, device=device)
        return func(*args, **kwargs)
    if func in DATA_CONSTRUCTORS:
        return call_with_data(func, args, kwargs, device)
    return call_on_device(func, args, kwargs, device)
