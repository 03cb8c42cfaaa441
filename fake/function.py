"""The Python-API side of fake tensors: devices in calls, before any dispatch.

``torch.ones(3, device="cuda")`` parses ``device=`` in C++ and initialises
CUDA right there, long before a dispatch mode could step in; on a CPU-only
build that is an error.  So the calls that carry a device are rewritten here:
the device becomes ``meta`` and the device meant is left in
:mod:`deferinit.fake.state` for the dispatch layer.  The same applies to
``Tensor.to``, ``Tensor.cuda`` and ``Tensor.new_*`` on fakes.
"""

from __future__ import annotations

import operator

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


_parse_to = torch._C._nn._parse_to
_no_torch_function = torch._C.DisableTorchFunction
# What _parse_to (the parser nn.Module.to uses) says where Tensor.to differs.
_COPY_REFUSED = "does not accept copy argument"
_NO_ACCELERATOR = "accelerator"


def _is_index(x) -> bool:
    # What PyTorch's parser takes for a device index: an integer, not a bool.
    return not isinstance(x, (bool, torch.Tensor)) and hasattr(type(x), "__index__")


def parse_to(args, kwargs, fake_cuda: bool = True):
    """Split the arguments of ``Tensor.to`` into (device, dtype, other keywords).

    PyTorch's own parser decides: ``torch._C._nn._parse_to`` takes the three
    signatures of ``Tensor.to`` (device and dtype, dtype, other tensor), the
    Python types ``bool``/``int``/``float``/``complex`` as dtypes, and raises
    eager's ``TypeError`` for anything else.  It refuses only two things
    ``Tensor.to`` takes: ``copy`` (always the last positional argument when
    given positionally), and, on a build without an accelerator, a device
    index, which is a CUDA device when CUDA is faked.  A fake ``other``
    tensor gives its reported device, not the one its C++ side holds.

    Example::

        >>> parse_to(("cuda", None, False), {})
        (device(type='cuda', index=0), None, {'non_blocking': False, 'copy': False, 'memory_format': None})
        >>> parse_to((float,), {"copy": True})[1:]
        (torch.float64, {'non_blocking': False, 'copy': True, 'memory_format': None})
    """
    args = list(args)
    kwargs = dict(kwargs)
    copy = False
    copy_taken = index_taken = False
    while True:
        try:
            with _no_torch_function():  # our own function mode would rewrite device=
                device, dtype, non_blocking, memory_format = _parse_to(*args, **kwargs)
            break
        except RuntimeError as e:
            message = str(e)
            if _COPY_REFUSED in message and not copy_taken:
                # The parser matched a signature, so copy is a bool.
                copy = kwargs.pop("copy") if "copy" in kwargs else args.pop()
                copy_taken = True
            elif _NO_ACCELERATOR in message and fake_cuda and not index_taken:
                if _is_index(kwargs.get("device")):
                    kwargs["device"] = torch.device("cuda", operator.index(kwargs["device"]))
                elif args and _is_index(args[0]):
                    args[0] = torch.device("cuda", operator.index(args[0]))
                else:
                    raise
                index_taken = True
            else:
                raise
    other = kwargs.get("tensor", args[0] if args else None)
    if isinstance(other, torch.Tensor):
        device = other.device  # a fake's reported device
    rest = {"non_blocking": non_blocking, "copy": copy, "memory_format": memory_format}
    return (normalize(device) if device is not None else None), dtype, rest


def tensor_to(self: torch.Tensor, args, kwargs, fake_cuda: bool = True, *, fake: bool = False):
    """``self.to(...)`` that never lets a fake device reach the argument parser.

    For a fake (``fake=True``), C++ may hold another device than the one
    reported (see ``deferinit.fake.device.backend_device``), so every move of a fake
    goes through the dispatch layer with the intended device.
    """
    device, dtype, rest = parse_to(args, kwargs, fake_cuda)
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
